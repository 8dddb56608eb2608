"""Damaged checkpoint files are named before any rank loads them (checkpoint/integrity.py): a
checkpoint laid out as ours (JSON files, torch distributed-checkpoint directories, torch.save
files), damaged one file at a time."""
import json
import os
import shutil
import warnings

import pytest
import torch

from swift_megatron.checkpoint.integrity import check_checkpoint_files
from swift_megatron.checkpoint.ms_swift import read_latest
from swift_megatron.errors import UserError


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("ckpt") / "iter_0000002"
    for name in ("model", "optimizer"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "assuming the intent is to save in a single process"
            dcp.save({"w": torch.arange(4096.0), "b": torch.ones(64)},
                     storage_writer=dcp.FileSystemWriter(str(root / name)))
        torch.save({"version": 1}, root / name / "common.pt")
    os.makedirs(root / "rng")
    torch.save({"cpu": torch.get_rng_state()}, root / "rng" / "rank0.pt")
    (root / "swift_megatron.json").write_text(json.dumps({"model_type": "qwen3"}))
    (root / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (root.parent / "latest_checkpointed_iteration.txt").write_text("2")
    return root


def damaged(intact, tmp_path, path, size=None, text=None):
    copy = tmp_path / "iter_0000002"
    shutil.copytree(intact, copy)
    target = copy / path
    if size is not None:
        os.truncate(target, size)
    if text is not None:
        target.write_bytes(text)
    return str(copy)


def test_an_intact_checkpoint_passes(intact):
    check_checkpoint_files(str(intact))
    assert read_latest(str(intact.parent)) == 2


@pytest.mark.parametrize("path, size, text, message", [
    ("trainer_state.json", 5, None, r"trainer_state.json: not valid JSON"),
    ("swift_megatron.json", None, b"\xff\xfe", r"swift_megatron.json: not valid JSON"),
    ("model/__0_0.distcp", 100, None, r"model/__0_0.distcp: truncated \(100 bytes, the metadata "
                                      r"needs \d+\)"),
    ("optimizer/__0_0.distcp", 0, None, r"optimizer/__0_0.distcp: truncated \(0 bytes"),
    ("optimizer/.metadata", 30, None, r"optimizer/.metadata: unreadable"),
    ("model/common.pt", 10, None, r"model/common.pt: not a readable torch.save file"),
    ("rng/rank0.pt", None, b"garbage", r"rng/rank0.pt: not a readable torch.save file"),
])
def test_each_damaged_file_is_named(intact, tmp_path, path, size, text, message):
    with pytest.raises(UserError, match=message + ".*the checkpoint is damaged"):
        check_checkpoint_files(damaged(intact, tmp_path, path, size, text))


def test_a_missing_data_file_is_named(intact, tmp_path):
    directory = damaged(intact, tmp_path, "model/common.pt")
    os.remove(os.path.join(directory, "model", "__0_0.distcp"))
    with pytest.raises(UserError, match=r"model/__0_0.distcp: missing"):
        check_checkpoint_files(directory)


@pytest.mark.parametrize("text", ["abc", "", "2.5", "-1"])
def test_a_garbage_latest_file_is_named(tmp_path, text):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
    with pytest.raises(UserError, match=r"latest_checkpointed_iteration.txt: expected an "
                                        r"iteration number"):
        read_latest(str(tmp_path))


def test_another_models_weights_are_named(single_process_group, tmp_path):
    """Weights of another model shape (--mcore_model of model A with --model of model B): one
    clear error naming the checkpoint and the mismatch (issue 40: megatron's
    CheckpointingException, wrapped in torch's CheckpointException, the checkpoint unnamed)."""
    from swift_megatron.checkpoint.dist import load_model, save_model
    from swift_megatron.model.build import build_model
    from swift_megatron.parallel.state import ParallelState

    def tiny(hidden):
        return build_model(dict(model_type="qwen3", vocab_size=64, hidden_size=hidden,
                                intermediate_size=2 * hidden, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                rms_norm_eps=1e-6, max_position_embeddings=64),
                           torch.float32, torch.device("cpu"))[0]

    ParallelState.initialize(device="cpu", seed=0)   # megatron on the CPU, on the fixture's world
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_model([tiny(32)], str(tmp_path / "a"))
            load_model([tiny(32)], str(tmp_path / "a"))   # the same shape loads
            with pytest.raises(UserError, match=r"a holds another model than the one built here "
                                                r".*Global shape mismatch .* give the checkpoint"):
                load_model([tiny(16)], str(tmp_path / "a"))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()   # the world is the fixture's
