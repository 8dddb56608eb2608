"""The on-disk layout of a Megatron model directory, shared by `megatron export --to_mcore` and
the trainer's checkpoints (so every training checkpoint is also a valid `--mcore_model`):

    DIR/swift_megatron.json   format, version, model_type, dtype, the layout it was saved with
    DIR/hf/                   config.json, generation_config.json, tokenizer files (no weights)
    DIR/model/                megatron distributed checkpoint of the weights (any layout loads it)

Training checkpoints add optimizer/ and trainer_state.json beside these (checkpoint/trainer.py).
"""
import json
import os
from typing import Sequence

import torch
import torch.distributed as dist

from swift_megatron.bridge.hf_checkpoint import copy_model_files
from swift_megatron.checkpoint.dist import load_model, save_model
from swift_megatron.errors import UserError

FORMAT = "swift_megatron.mcore"
META = "swift_megatron.json"


def write_model_dir(chunks: Sequence[torch.nn.Module], directory: str, *, hf_source_dir: str,
                    meta: dict) -> None:
    """Save weights under DIR/model and the HF config/tokenizer under DIR/hf (collective)."""
    save_model(chunks, os.path.join(directory, "model"), exist_ok=True)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(directory, "hf"), exist_ok=True)
        copy_model_files(hf_source_dir, os.path.join(directory, "hf"))
        with open(os.path.join(directory, META), "w") as f:
            json.dump({"format": FORMAT, "version": 1, **meta}, f, indent=2)
    dist.barrier()


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        raise UserError(f"{directory} is not a swift-megatron model directory (no {META}); "
                        "create one with `megatron export --to_mcore true` or `megatron rlhf --save`")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: unknown format {meta.get('format')!r}")
    return meta


def hf_dir(directory: str) -> str:
    """The HF config/tokenizer directory inside a model directory."""
    return os.path.join(directory, "hf")


def load_model_dir(chunks: Sequence[torch.nn.Module], directory: str) -> None:
    read_meta(directory)
    load_model(chunks, os.path.join(directory, "model"))
