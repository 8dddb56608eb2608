"""`megatron export` end to end as subprocesses (python -m swift_megatron.cli.main export ...) on
the tiny qwen3_moe checkpoint (its float32 logits differ from transformers by ~1e-7, not 0, so
an absurd tolerance fails): --to_mcore with the precision check into an existing directory with
--exist_ok, --to_hf back to the original tensors, the precision check failing with exit 2,
--to_hf in bfloat16, output directory protection, bad inputs without traceback, NPROC_PER_NODE=2
with TP=2, and docs/export.md listing every flag.
Checks that fail before any model is built run the same entry point in-process (faster)."""
import json
import os
import subprocess

import pytest
import torch

from swift_megatron.cli.main import main
from swift_megatron.errors import UserError
from tests.distributed.launch import REPO, run_cli_together
from tests.helpers import safetensors_of

FAMILY = "qwen3_moe"


def export(*argv, env=None, timeout=300, warm_start=True):
    return run_cli_together([(["export", *argv], env or {})], timeout, warm_start)[0]


def export_in_process(capsys, *argv):
    """The same entry point in this process, for the checks that fail before any model is built
    (they import nothing that changes this process's state)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, exit_info.value.code, out, err)


def assert_user_error(proc, message):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return tiny_model_dir(FAMILY)


@pytest.fixture(scope="module")
def mcore_dir(hf_model, tmp_path_factory):
    """--to_mcore with the precision check, into a non-empty directory with --exist_ok true."""
    out = tmp_path_factory.mktemp("export") / "mcore"
    out.mkdir()
    (out / "stale.txt").write_text("replaced by the export")
    proc = export("--model", hf_model, "--to_mcore", "true", "--output_dir", out, "--exist_ok",
                  "true", "--test_convert_precision", "true")
    return out, proc


def test_to_mcore_writes_a_model_directory(mcore_dir):
    out, proc = mcore_dir
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(out)) == ["hf", "model", "swift_megatron.json"]  # stale file gone
    meta = json.loads((out / "swift_megatron.json").read_text())
    assert meta["model_type"] == FAMILY and meta["dtype"] == "float32"
    assert meta["saved_with"] == {"tp": 1, "pp": 1, "ep": 1, "etp": 1}
    assert (out / "hf" / "tokenizer.json").is_file() and (out / "model" / "metadata.json").is_file()


def test_precision_check_prints_its_numbers(mcore_dir):
    out = mcore_dir[1].stdout
    for row in ("max abs logit diff", "mean abs logit diff", "argmax agreement", "-> PASS"):
        assert row in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_to_hf_gives_back_the_original_tensors(dtype, mcore_dir, hf_model, tmp_path):
    """float32: the tensors bit for bit; bfloat16: rounded, and the precision check compares
    equally rounded weights, so it passes as tightly."""
    flags = ([] if dtype == "float32"
             else ["--torch_dtype", dtype, "--test_convert_precision", "true"])
    proc = export("--mcore_model", mcore_dir[0], "--to_hf", "true", "--output_dir", tmp_path / "hf",
                  *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    original, exported = safetensors_of(hf_model), safetensors_of(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor.to(getattr(torch, dtype))), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == dtype
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    if flags:
        assert "float32 (bfloat16 weights)" in proc.stdout and "-> PASS" in proc.stdout


def test_qwen3_5_round_trip_through_megatron_keeps_vision_and_mtp(tiny_model_dir, tmp_path):
    """The hybrid Gated DeltaNet model: HF -> Megatron -> HF, both precision checks pass, and the
    output holds the source's tensors bit for bit, the vision tower and MTP head (not part of
    the Megatron model) copied from --model."""
    model = tiny_model_dir("qwen3_5")
    proc = export("--model", model, "--to_mcore", "true", "--output_dir", tmp_path / "mcore",
                  "--test_convert_precision", "true")
    assert proc.returncode == 0 and "-> PASS" in proc.stdout, proc.stdout + proc.stderr
    proc = export("--mcore_model", tmp_path / "mcore", "--model", model, "--to_hf", "true",
                  "--output_dir", tmp_path / "hf", "--test_convert_precision", "true")
    assert proc.returncode == 0 and "-> PASS" in proc.stdout, proc.stdout + proc.stderr
    original, exported = safetensors_of(model), safetensors_of(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    assert any(n.startswith("model.visual.") for n in original) and "mtp.fc.weight" in original
    assert all(torch.equal(exported[n], t) for n, t in original.items())


def test_qwen3_vl_round_trip_through_megatron_is_bit_exact(tiny_model_dir, tmp_path):
    """Qwen3-VL: HF -> Megatron checkpoint -> HF gives every tensor back bit for bit, the
    vision tower's and deepstack mergers' included (held by the Megatron model)."""
    model = tiny_model_dir("qwen3_vl")
    proc = export("--model", model, "--to_mcore", "true", "--output_dir", tmp_path / "mcore")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = export("--mcore_model", tmp_path / "mcore", "--model", model, "--to_hf", "true",
                  "--output_dir", tmp_path / "hf")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    original, exported = safetensors_of(model), safetensors_of(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    assert sum(".deepstack_merger_list." in n for n in original) == 12
    assert all(torch.equal(exported[n], t) for n, t in original.items())


def test_precision_check_fails_past_its_tolerance(hf_model):
    proc = export("--model", hf_model, "--test_convert_precision", "true",
                  "--test_convert_precision_atol", "1e-30")
    assert_user_error(proc, "precision check failed: max abs logit diff")
    assert "--test_convert_precision_atol 1e-30" in proc.stderr


@pytest.mark.parametrize("direction", ["to_mcore", "to_hf"])
def test_existing_output_dir_is_left_untouched(direction, hf_model, mcore_dir, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    source = ["--model", hf_model] if direction == "to_mcore" else ["--mcore_model", mcore_dir[0]]
    proc = export_in_process(capsys, *source, f"--{direction}", "true", "--output_dir", tmp_path)
    assert_user_error(proc, "pass --exist_ok true")
    assert os.listdir(tmp_path) == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "mine"
    assert not any(p.name.startswith(tmp_path.name + ".tmp") for p in tmp_path.parent.iterdir())


def test_missing_model_dir_is_a_user_error(tmp_path):
    proc = export("--model", tmp_path / "nope", "--to_mcore", "true",
                  "--output_dir", tmp_path / "o")
    assert_user_error(proc, "no such directory")
    assert not (tmp_path / "o").exists()


def test_hf_directory_is_not_a_megatron_model_directory(hf_model, tmp_path, capsys):
    proc = export_in_process(capsys, "--mcore_model", hf_model, "--to_hf", "true",
                             "--output_dir", tmp_path / "o")
    assert_user_error(proc, "is not a swift-megatron model directory")


def test_layout_that_does_not_divide_the_model_is_a_user_error(hf_model, tmp_path, capsys):
    proc = export_in_process(capsys, "--model", hf_model, "--to_mcore", "true",
                             "--output_dir", tmp_path / "o", "--tensor_model_parallel_size", "3")
    assert_user_error(proc, "tensor_model_parallel_size=3 does not divide")


@pytest.mark.slow
def test_nproc_per_node_relaunches_under_torchrun(tiny_model_dir, tmp_path):
    out = tmp_path / "tp2"
    proc = export("--model", tiny_model_dir("qwen3"), "--to_mcore", "true", "--output_dir", out,
                  "--tensor_model_parallel_size", "2", "--test_convert_precision", "true",
                  env={"NPROC_PER_NODE": "2"}, warm_start=False)   # MASTER_PORT: run_cli_together
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launching:" in proc.stdout and "-> PASS" in proc.stdout
    meta = json.loads((out / "swift_megatron.json").read_text())
    assert meta["saved_with"]["tp"] == 2


def test_docs_list_every_export_flag():
    from swift_megatron.arguments.commands import ExportCommandArguments
    from swift_megatron.arguments.parser import command_groups, group_specs

    docs = (REPO / "docs" / "export.md").read_text()
    missing = [spec.name for _, group in command_groups(ExportCommandArguments)
               for spec in group_specs(group) if f"`--{spec.name}`" not in docs]
    assert missing == []


# ---- ms-swift's forms: flag rules and --dry_run (in process, nothing loaded) ----------------

def parsed(*argv):
    from swift_megatron.arguments.commands import ExportCommandArguments
    from swift_megatron.arguments.parser import parse_command

    return parse_command(ExportCommandArguments, list(map(str, argv)), prog="megatron export")


@pytest.mark.parametrize("flags, merge", [(["--to_hf", "true"], True),
                                          (["--to_mcore", "true"], False),
                                          (["--to_hf", "true", "--merge_lora", "false"], False)])
def test_merge_lora_defaults_to_to_hf_as_in_ms_swift(flags, merge):
    args = parsed("--model", "m", "--adapters", "a", *flags)
    assert args.export.merge_lora is merge


@pytest.mark.parametrize("flags", [["--context_parallel_size", "2"],
                                   ["--virtual_pipeline_model_parallel_size", "2",
                                    "--pipeline_model_parallel_size", "2"]])
def test_context_and_interleaved_parallelism_are_refused(flags):
    with pytest.raises(UserError, match="loads the model in a TP/PP/EP layout only"):
        parsed("--model", "m", "--to_mcore", "true", *flags)


@pytest.mark.parametrize("flags, default", [
    (["--model", "org/Qwen3-8B", "--to_mcore", "true"], "Qwen3-8B-mcore"),
    (["--mcore_model", "out/ckpt/", "--to_hf", "true"], "out/ckpt-hf"),
    (["--model", "m", "--mcore_adapter", "out/checkpoint-10", "--to_hf", "true"],
     "out/checkpoint-10-hf")])
def test_output_dir_defaults_as_in_ms_swift(flags, default):
    assert parsed(*flags).export.output_dir == default


@pytest.mark.parametrize("flags, message", [
    (["--model", "m", "--adapters", "a", "--mcore_adapter", "b", "--to_hf", "true"],
     "pass one of --adapters and --mcore_adapter"),
    (["--model", "m", "--mcore_adapter", "b", "--merge_lora", "true", "--output_dir", "o"],
     "--mcore_adapter needs --to_hf true or --to_mcore true"),
    (["--model", "m", "--to_hf", "true"], "pass --mcore_model, or --adapters / --mcore_adapter"),
    (["--to_mcore", "true"], "pass the model"),
    (["--model", "m"], "nothing to do")])
def test_inconsistent_forms_are_user_errors(flags, message, capsys):
    assert_user_error(export_in_process(capsys, *flags), message)


def lora_checkpoint(root):
    """Our LoRA checkpoint's layout (what `prepare` looks at; no weights)."""
    os.makedirs(root / "adapter")
    (root / "swift_megatron.json").write_text("{}")
    return root


def test_a_lora_checkpoint_as_mcore_model_is_refused_not_dropped(tmp_path, capsys):
    proc = export_in_process(capsys, "--mcore_model", lora_checkpoint(tmp_path / "ckpt"),
                             "--to_hf", "true", "--output_dir", tmp_path / "o")
    assert_user_error(proc, "is a LoRA checkpoint (it holds adapter/): pass it as --mcore_adapter")


def test_dry_run_prints_the_plan_and_writes_nothing(hf_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    out = tmp_path / "mcore"
    proc = export_in_process(capsys, "--model", hf_model, "--to_mcore", "true", "--output_dir",
                             out, "--tensor_model_parallel_size", "2", "--dry_run", "true",
                             "--test_convert_precision", "true", "--test_convert_dtype",
                             "bfloat16")
    assert proc.returncode == 0, proc.stderr
    for line in (f"base weights      HF checkpoint {hf_model} (qwen3_moe, float32)",
                 f"writes            Megatron model directory (float32) at {out}",
                 "layout            TP=2 PP=1 EP=1 ETP=2 on 2 process(es) (DP=1)",  # ETP follows TP
                 f"precision check   bfloat16 logits vs transformers on {hf_model}"):
        assert line in proc.stdout, proc.stdout
    assert not out.exists() and os.listdir(tmp_path) == []


def test_dry_run_of_an_adapter_form(hf_model, tmp_path, capsys):
    from swift_megatron.lora import LoraConfig
    from swift_megatron.lora.peft_io import peft_config_dict

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = peft_config_dict(LoraConfig(r=4, lora_alpha=8), ["q_proj", "v_proj"], hf_model)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_text("never read by a dry run")
    proc = export_in_process(capsys, "--adapters", adapter, "--to_mcore", "true",
                             "--dry_run", "true")
    assert proc.returncode == 0, proc.stderr
    assert (f"adapter           PEFT adapter {adapter} (r=4, alpha=8, q_proj, v_proj): kept "
            "beside the weights (a LoRA checkpoint)") in proc.stdout
    assert f"writes            Megatron model directory (float32) at {adapter}-mcore" in proc.stdout


def test_dry_run_does_not_download_a_hub_id(tmp_path, capsys):
    proc = export_in_process(capsys, "--model", "no-such-org/no-such-model", "--to_mcore", "true",
                             "--output_dir", tmp_path / "o", "--dry_run", "true")
    assert proc.returncode == 0, proc.stderr
    assert "(not checked (a hub id: downloaded at run time))" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--tensor_model_parallel_size", "2"], "TP x PP = 2 needs a multiple of 2 processes"),
    (["--tensor_model_parallel_size", "3"], "tensor_model_parallel_size=3 does not divide")])
def test_dry_run_fails_like_the_run(hf_model, tmp_path, flags, message, capsys):
    proc = export_in_process(capsys, "--model", hf_model, "--to_mcore", "true", "--output_dir",
                             tmp_path / "o", "--dry_run", "true", *flags)
    assert_user_error(proc, message)


def test_check_model_finds_a_truncated_shard(tiny_model_dir, tmp_path):
    """--check_model (default true) reads every shard's header before anything loads."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir("qwen3"), model)
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 10)
    from swift_megatron import export
    from swift_megatron.arguments.commands import ExportCommandArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.errors import UserError

    argv = ["--model", str(model), "--to_mcore", "true", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(UserError, match=r"model\.safetensors: truncated"):
        export.prepare(parse_command(ExportCommandArguments, argv, "megatron export"), 1)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen2_5_vl_precision_check_runs_with_an_image(tiny_model_dir, family):
    """Qwen2.5-VL and Qwen3-VL (float32): the check feeds an image per sequence through the
    model directory's image processor to both models (transformers' whole image-text-to-text
    model; precision_images.py; Qwen3-VL with deepstack) and they agree (measured:
    docs/multimodal.md)."""
    proc = export("--model", tiny_model_dir(family), "--test_convert_precision", "true",
                  "--test_convert_precision_atol", "1e-5")
    assert proc.returncode == 0 and "-> PASS" in proc.stdout, proc.stdout + proc.stderr
    assert "float32, an image in each sequence" in proc.stdout
    line = next(l for l in proc.stdout.splitlines() if "argmax agreement" in l)
    assert float(line.split()[-1]) == 1.0
    print(proc.stdout)


def test_qwen3_5_precision_check_runs_with_an_image(tmp_path):
    """Qwen3.5 with its vision tower and an image processor (fixtures' images=True): the same
    check with an image per sequence, through the interleaved M-RoPE (measured 2.1e-7:
    docs/multimodal.md); without an image processor the check stays text-only (the round trip
    test above)."""
    from swift_megatron.fixtures import build_tiny_model

    model = build_tiny_model("qwen3_5", str(tmp_path / "qwen3_5"), images=True)
    proc = export("--model", model, "--test_convert_precision", "true",
                  "--test_convert_precision_atol", "1e-5")
    assert proc.returncode == 0 and "-> PASS" in proc.stdout, proc.stdout + proc.stderr
    assert "float32, an image in each sequence" in proc.stdout
