"""Every export example script (scripts/export/*.sh) passes `--dry_run true` on the tiny
fixture model: its flags parse, and its inputs, layout and world size check out. A dry run reads
no weights, so the Megatron checkpoint and adapter inputs here are skeletons (their metadata
files only)."""
import glob
import json
import os
import re
import shutil
import subprocess

import pytest

from swift_megatron.lora import LoraConfig
from swift_megatron.lora.peft_io import peft_config_dict
from tests.distributed.launch import REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "scripts", "export", "*.sh")))
# script (and MODE) -> environment beyond MODEL and OUTPUT_DIR; @name: that inputs() path
RUNS = {"hf_to_mcore.sh": {}, "precision_check.sh": {},
        "mcore_to_hf.sh": {"MCORE_MODEL": "@mcore"}, "merge_lora.sh": {"ADAPTER": "@peft"},
        "merge_lora.sh CKPT": {"CKPT": "@lora_ckpt"},
        "lora_forms.sh merged_mcore": {"MODE": "merged_mcore", "CKPT": "@lora_ckpt"},
        "lora_forms.sh to_mcore": {"MODE": "to_mcore", "ADAPTER": "@peft"}}


def peft_skeleton(path, base):
    os.makedirs(path)
    config = peft_config_dict(LoraConfig(r=4, lora_alpha=8), ["q_proj", "v_proj"], base)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    open(os.path.join(path, "adapter_model.safetensors"), "w").close()


def model_dir_skeleton(path, hf_dir, adapter_base=None):
    """Our model directory (a LoRA checkpoint with `adapter_base`) without weights."""
    shutil.copytree(hf_dir, os.path.join(path, "hf"),
                    ignore=shutil.ignore_patterns("*.safetensors"))
    with open(os.path.join(path, "swift_megatron.json"), "w") as f:
        json.dump({"format": "swift_megatron.mcore", "version": 1, "model_type": "qwen3",
                   "dtype": "float32"}, f)
    if adapter_base:
        peft_skeleton(os.path.join(path, "adapter"), adapter_base)


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("script_inputs")
    model = tiny_model_dir("qwen3")
    paths = {name: str(root / name) for name in ("mcore", "peft", "lora_ckpt")}
    model_dir_skeleton(paths["mcore"], model)
    model_dir_skeleton(paths["lora_ckpt"], model, adapter_base=model)
    peft_skeleton(paths["peft"], model)
    return model, paths


def test_every_script_is_checked():
    assert {os.path.basename(s) for s in SCRIPTS} == {run.split()[0] for run in RUNS}


@pytest.mark.parametrize("run", list(RUNS))
def test_script_dry_run(run, inputs, tmp_path):
    model, paths = inputs
    env = dict(os.environ, MODEL=model, OUTPUT_DIR=str(tmp_path / "out"), OUT=str(tmp_path / "out"))
    env.update({k: paths[v[1:]] if v.startswith("@") else v for k, v in RUNS[run].items()})
    env.pop("NPROC_PER_NODE", None)
    script = os.path.join(REPO, "scripts", "export", run.split()[0])
    proc = subprocess.run(["bash", script, "--dry_run", "true"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "megatron export --dry_run: nothing was loaded" in proc.stdout
    for written in re.findall(r"^  writes .* at (\S+)$", proc.stdout, re.MULTILINE):
        assert not os.path.exists(written)
