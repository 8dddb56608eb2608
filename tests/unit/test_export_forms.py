"""`megatron export` with LoRA adapters, every form of ms-swift's example scripts
(examples/megatron/export/{lora,merge_lora}.sh) and ours, on the tiny Qwen3 with an adapter
peft itself made (rank 4 on all seven projections, random nonzero B), in float32.

The forms run as one chain in one subprocess (tests/export_jobs.py, ~15 s on 2 cores):

    lora_ckpt      --model HF --adapters PEFT --to_mcore true            -> LoRA checkpoint L
    peft           --model HF --mcore_adapter L --to_hf true --merge_lora false -> PEFT
    merged_hf      --model HF --mcore_adapter L --to_hf true             -> merged HF
    merged_mcore   --model HF --mcore_adapter L --to_mcore true --merge_lora true
    merged_mcore_hf  --mcore_model <merged_mcore> --to_hf true
    own_base       --adapters L --to_hf true --merge_lora true           (base: L's own weights)
    args_json      --adapters CKPT --to_hf true --merge_lora true        (base: CKPT/args.json)
    ours_merge     --model HF --adapters PEFT --merge_lora true          (our original form)
    merged_mcore_tp2 (+ _hf)  merged_mcore with TP=2 (two processes), then --to_hf

The first four also run the precision check (Megatron vs transformers + peft). The adapter
survives every conversion bit for bit, the merged HF checkpoint equals peft's merge_and_unload
within float32 rounding, and every merge path gives the same tensors bit for bit.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import REPO, free_port
from tests.helpers import safetensors_of

MERGE_ATOL = 1e-6
PRECISION_JOBS = ("lora_ckpt", "peft", "merged_hf", "merged_mcore")


def make_peft_adapter(hf_dir: str, out_dir: str) -> str:
    import peft
    from transformers import AutoModelForCausalLM

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def ms_swift_lora_checkpoint(peft_dir: str, hf_dir: str, out_dir) -> str:
    """What ms-swift's LoRA checkpoint-N/ holds besides its distributed checkpoint: the PEFT
    files (its save_safetensors default) and args.json naming the base model."""
    shutil.copytree(peft_dir, out_dir)
    config = json.loads((out_dir / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    (out_dir / "args.json").write_text(json.dumps({"model": hf_dir, "tuner_type": "lora",
                                                   "lora_rank": 4, "lora_alpha": 8}))
    return str(out_dir)


def jobs(hf, peft_dir, ms_ckpt, root):
    out = {name: root / name for name in ("lora_ckpt", "peft", "merged_hf", "merged_mcore",
                                          "merged_mcore_hf", "own_base", "args_json",
                                          "ours_merge", "merged_mcore_tp2", "merged_mcore_tp2_hf")}
    check = ["--test_convert_precision", "true"]
    lora = ["--mcore_adapter", out["lora_ckpt"]]
    return out, [
        ("lora_ckpt", ["--model", hf, "--adapters", peft_dir, "--to_mcore", "true", *check]),
        ("peft", ["--model", hf, *lora, "--to_hf", "true", "--merge_lora", "false", *check]),
        ("merged_hf", ["--model", hf, *lora, "--to_hf", "true", *check]),
        ("merged_mcore", ["--model", hf, *lora, "--to_mcore", "true", "--merge_lora", "true",
                          *check]),
        ("merged_mcore_hf", ["--mcore_model", out["merged_mcore"], "--to_hf", "true"]),
        ("own_base", ["--adapters", out["lora_ckpt"], "--to_hf", "true", "--merge_lora", "true"]),
        ("args_json", ["--adapters", ms_ckpt, "--to_hf", "true", "--merge_lora", "true"]),
        ("ours_merge", ["--model", hf, "--adapters", peft_dir, "--merge_lora", "true"]),
        ("merged_mcore_tp2", ["--model", hf, *lora, "--to_mcore", "true", "--merge_lora", "true",
                              "--tensor_model_parallel_size", 2],
         {"NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}),
        ("merged_mcore_tp2_hf", ["--mcore_model", out["merged_mcore_tp2"], "--to_hf", "true"]),
    ]


def sections(stdout: str) -> dict:
    """{job: (exit code, its output)} from tests/export_jobs.py's markers."""
    found, start = {}, 0
    for match in re.finditer(r"^=== (\S+) exit=(\d+)$", stdout, re.MULTILINE):
        found[match.group(1)] = (int(match.group(2)), stdout[start:match.start()])
        start = match.end()
    return found


@pytest.fixture(scope="module")
def forms(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("export_forms")
    hf = tiny_model_dir("qwen3")
    peft_dir = make_peft_adapter(hf, str(root / "peft_adapter"))
    ms_ckpt = ms_swift_lora_checkpoint(peft_dir, hf, root / "checkpoint-10")
    out, chain = jobs(hf, peft_dir, ms_ckpt, root)
    chain = [[name, list(map(str, argv + ["--output_dir", out[name]])), *env]
             for name, argv, *env in chain]
    (root / "jobs.json").write_text(json.dumps(chain))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), SWIFT_MEGATRON_NO_BAR="1")
    proc = subprocess.run([sys.executable, "-m", "tests.export_jobs", str(root / "jobs.json")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    return dict(hf=hf, peft=peft_dir, out=out, proc=proc, sections=sections(proc.stdout))


def test_every_form_succeeds(forms):
    proc = forms["proc"]
    codes = {name: code for name, (code, _) in forms["sections"].items()}
    assert codes == dict.fromkeys(forms["out"], 0), proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("job", PRECISION_JOBS)
def test_precision_check_passes_against_transformers_with_peft(forms, job):
    text = forms["sections"][job][1]
    print(text[text.find("precision check"):])
    assert "-> PASS" in text


def test_to_mcore_keeps_the_adapter_as_a_lora_checkpoint(forms):
    lora_ckpt, merged = forms["out"]["lora_ckpt"], forms["out"]["merged_mcore"]
    assert sorted(os.listdir(lora_ckpt)) == ["adapter", "hf", "model", "swift_megatron.json"]
    assert sorted(os.listdir(merged)) == ["hf", "model", "swift_megatron.json"]
    kept = load_file(str(lora_ckpt / "adapter" / "adapter_model.safetensors"))
    original = load_file(os.path.join(forms["peft"], "adapter_model.safetensors"))
    assert sorted(kept) == sorted(original)
    assert all(torch.equal(kept[k], original[k]) for k in original)


def test_merge_lora_false_writes_the_adapter_in_peft_format(forms):
    written = forms["out"]["peft"]
    tensors = load_file(str(written / "adapter_model.safetensors"))
    original = load_file(os.path.join(forms["peft"], "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(original)
    assert all(torch.equal(tensors[k], original[k]) for k in original)
    config = json.loads((written / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == \
        (4, 8, forms["hf"])


def peft_merged(hf: str, adapter: str) -> dict:
    import peft
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), adapter)
    return {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}


def test_merged_checkpoint_equals_peft_merge_and_unload(forms):
    merged = safetensors_of(forms["out"]["merged_hf"])
    reference = peft_merged(forms["hf"], forms["peft"])
    assert sorted(merged) == sorted(k for k in reference if k != "lm_head.weight")  # tied
    diff = max((merged[k] - reference[k]).abs().max().item() for k in merged)
    print(f"merged vs peft merge_and_unload: max abs diff {diff:.3e}")
    assert diff <= MERGE_ATOL


@pytest.mark.parametrize("job", ["merged_mcore_hf", "own_base", "args_json", "ours_merge"])
def test_every_merge_path_gives_the_same_tensors(forms, job):
    expected, got = safetensors_of(forms["out"]["merged_hf"]), safetensors_of(forms["out"][job])
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_merging_with_tp2_gives_the_same_model(forms):
    """Each rank merges its shard; the products B A are summed over r alone, so TP changes at
    most the last bit."""
    meta = json.loads((forms["out"]["merged_mcore_tp2"] / "swift_megatron.json").read_text())
    assert meta["saved_with"]["tp"] == 2
    expected = safetensors_of(forms["out"]["merged_hf"])
    got = safetensors_of(forms["out"]["merged_mcore_tp2_hf"])
    assert sorted(got) == sorted(expected)
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"merged with TP=2 vs TP=1: max abs diff {diff:.3e}")
    assert diff <= MERGE_ATOL
