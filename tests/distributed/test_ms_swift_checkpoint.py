"""ms-swift Megatron checkpoints (swift_megatron/checkpoint/ms_swift.py, ms_swift_lora.py) load
into our model. ~75 s in all.

One run of two gloo processes (workers/ms_swift_layouts.py) writes tiny Qwen3 and Qwen3-MoE
checkpoints the way ms-swift does (workers/ms_swift_format.py: megatron-core's GPTModel with
Transformer Engine key names, {'model': ...} nesting, args.json, latest file, vocab padded to
128 x TP, a common.pt that needs ms-swift to unpickle): the dense model saved with TP=2, the MoE
model with EP=2 (and once with its layers stored one by one, as megatron does for models whose
layers differ), a bfloat16 dense one with TP=1, and LoRA checkpoints (adapter tensors only, on
the fused linears) with TP=2 and EP=2. Each full model loads with TP=1 (DP=2) and with TP=2 (MoE:
TP=2 x ETP=2) and exports every original HF tensor bit for bit, with logits matching
transformers; the dense one also loads into a model already carrying LoRA adapters.

Then `megatron export` on them, in one process: --to_hf (float32, bfloat16), --to_mcore, and
the LoRA checkpoints as --mcore_adapter (PEFT output, bit for bit the adapter they were written
from; merged output), with the precision check; and the checkpoint kinds that are refused or
resolved without loading weights.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from swift_megatron.checkpoint import sources
from swift_megatron.checkpoint.ms_swift import (is_ms_swift_checkpoint, read_ms_swift_checkpoint,
                                                stored_keys)
from swift_megatron.errors import UserError
from tests.distributed.launch import REPO, run_cli_together, run_workers
from tests.helpers import safetensors_of

ATOL = 1e-4
LOADS = {"dense_tp1": ("dense", {}), "dense_tp2": ("dense", dict(tp=2)),
         "moe_tp1": ("moe", {}), "moe_tp2_etp2": ("moe", dict(tp=2, etp=2)),
         "moe_per_layer_tp2": ("moe_per_layer", dict(tp=2))}


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"dense": tiny_model_dir("qwen3"), "moe": tiny_model_dir("qwen3_moe")}


def shared_a_adapter(hf_dir: str, out_dir) -> str:
    """A PEFT adapter (rank 4) on every projection whose q, k, v and gate, up share one A, as
    ms-swift's adapters on the fused linears do; random A and nonzero B."""
    from safetensors.torch import save_file

    from swift_megatron.lora import LoraConfig
    from swift_megatron.lora.peft_io import peft_config_dict

    c = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"]
    gen, tensors = torch.Generator().manual_seed(11), {}

    def add(modules, a_in, outs):
        a = torch.randn(4, a_in, generator=gen) * 0.1
        for module, rows in zip(modules, outs):
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = \
                torch.randn(rows, 4, generator=gen) * 0.1

    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        add([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"], h, [q, kv, kv])
        add([p + "self_attn.o_proj"], q, [h])
        mlps = [(p + f"mlp.experts.{e}.", c["moe_intermediate_size"])
                for e in range(c["num_experts"])] if c.get("num_experts") else \
            [(p + "mlp.", c["intermediate_size"])]
        for mlp, ffn in mlps:
            add([mlp + "gate_proj", mlp + "up_proj"], h, [ffn, ffn])
            add([mlp + "down_proj"], ffn, [h])
    os.makedirs(out_dir)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft_config_dict(LoraConfig(r=4, lora_alpha=8), targets, hf_dir)
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return str(out_dir)


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("ms_swift")
    ckpt = {"dense": str(out / "dense_tp2"), "moe": str(out / "moe_ep2"),
            "dense_bf16": str(out / "dense_bf16"), "moe_per_layer": str(out / "moe_per_layer"),
            "lora_dense": str(out / "lora_dense_tp2"), "lora_moe": str(out / "lora_moe_ep2"),
            "peft_dense": shared_a_adapter(models["dense"], out / "peft_dense"),
            "peft_moe": shared_a_adapter(models["moe"], out / "peft_moe")}
    jobs = [dict(name="write_dense", hf_dir=models["dense"], write=ckpt["dense"], tp=2),
            dict(name="write_moe", hf_dir=models["moe"], write=ckpt["moe"], ep=2),
            dict(name="write_dense_bf16", hf_dir=models["dense"], write=ckpt["dense_bf16"],
                 dtype="bfloat16"),
            dict(name="write_moe_per_layer", hf_dir=models["moe"], write=ckpt["moe_per_layer"],
                 per_layer=True),
            dict(name="write_lora_dense", hf_dir=models["dense"], peft_dir=ckpt["peft_dense"],
                 write_lora=ckpt["lora_dense"], tp=2),
            dict(name="write_lora_moe", hf_dir=models["moe"], peft_dir=ckpt["peft_moe"],
                 write_lora=ckpt["lora_moe"], ep=2)]
    jobs += [dict(name=name, hf_dir=models[kind.split("_")[0]], load=ckpt[kind], **layout)
             for name, (kind, layout) in LOADS.items()]
    jobs.append(dict(name="dense_tp2_lora", hf_dir=models["dense"], lora_load=ckpt["dense"], tp=2))
    (out / "jobs.json").write_text(json.dumps(jobs))
    return ckpt, run_workers("ms_swift_layouts.py", 2, out, ["--jobs", out / "jobs.json"])


@pytest.fixture(scope="module")
def exports(run, models, tmp_path_factory):
    """`megatron export` on the checkpoints, one process (tests/export_jobs.py): --to_hf of the
    float32 and the bfloat16 one (the checkpoint's dtype, from args.json, is the default; the
    precision check loads the bfloat16 weights in float32 and compares equally rounded
    weights), --to_mcore of the MoE one."""
    out = tmp_path_factory.mktemp("ms_swift_exports")
    check = ["--test_convert_precision", "true"]
    ckpt = run[0]
    jobs = [["dense", ["--mcore_model", ckpt["dense"], "--to_hf", "true", *check]],
            ["dense_bf16", ["--mcore_model", ckpt["dense_bf16"], "--to_hf", "true", *check]],
            ["moe_mcore", ["--mcore_model", ckpt["moe"], "--to_mcore", "true",
                           "--model", models["moe"], *check]],
            ["lora_dense_peft", ["--model", models["dense"], "--mcore_adapter", ckpt["lora_dense"],
                                 "--to_hf", "true", "--merge_lora", "false", *check]],
            ["lora_moe_peft", ["--model", models["moe"], "--mcore_adapter", ckpt["lora_moe"],
                               "--to_hf", "true", "--merge_lora", "false"]],
            ["lora_moe_merged", ["--model", models["moe"], "--mcore_adapter", ckpt["lora_moe"],
                                 "--to_hf", "true", *check]]]
    for name, argv in jobs:
        argv += ["--output_dir", str(out / name)]
    (out / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), SWIFT_MEGATRON_NO_BAR="1")
    proc = subprocess.run([sys.executable, "-m", "tests.export_jobs", str(out / "jobs.json")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    return out, proc


# ---- the format ---------------------------------------------------------------------------

@pytest.mark.slow
def test_the_fixture_has_ms_swifts_names_and_padding(run):
    ckpt = run[0]
    dense = read_ms_swift_checkpoint(ckpt["dense"])
    keys = stored_keys(dense.iter_dir)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    moe_keys = stored_keys(read_ms_swift_checkpoint(ckpt["moe"]).iter_dir)
    assert {"decoder.layers.pre_mlp_layernorm.weight",
            "decoder.layers.mlp.experts.experts.linear_fc1.weight"} <= moe_keys
    per_layer = stored_keys(read_ms_swift_checkpoint(ckpt["moe_per_layer"]).iter_dir)
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in per_layer
    assert dense.args["tensor_model_parallel_size"] == 2 and dense.tuner_type == "full"
    from torch.distributed.checkpoint import FileSystemReader

    shapes = FileSystemReader(dense.iter_dir).read_metadata().state_dict_metadata
    vocab = json.loads(open(os.path.join(dense.args["model"], "config.json")).read())["vocab_size"]
    assert shapes["embedding.word_embeddings.weight"].size[0] == -(-vocab // 256) * 256 > vocab
    with pytest.raises(ModuleNotFoundError, match="swift"):  # so the loader cannot have read it
        torch.load(os.path.join(dense.iter_dir, "common.pt"), weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("job", [*LOADS, "dense_tp2_lora"])
def test_every_layout_loads_the_original_tensors(run, job):
    for rank in run[1]:
        result = rank[job]["export"]
        assert result["mismatched"] == [] and result["missing"] == []
        assert result["duplicates"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("job", list(LOADS))
def test_logits_match_transformers(run, job):
    report = run[1][0][job]["precision"]
    print(f"{job}: {json.dumps(report)}")
    assert report["max_abs_diff"] <= ATOL and report["argmax_agreement"] == 1.0


# ---- megatron export on them --------------------------------------------------------------

@pytest.mark.slow
def test_exports_succeed_with_the_precision_check(exports):
    proc = exports[1]
    assert proc.returncode == 0 and proc.stdout.count("-> PASS") == 5, \
        proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "exit=2" not in proc.stdout
    print("\n".join(line for line in proc.stdout.splitlines()
                    if "max abs logit diff" in line or line.startswith("===")))


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", [("dense", "float32"), ("dense_bf16", "bfloat16")])
def test_to_hf_gives_the_original_tensors(exports, models, name, dtype):
    original, exported = safetensors_of(models["dense"]), safetensors_of(exports[0] / name)
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor.to(getattr(torch, dtype))), key


@pytest.mark.slow
def test_to_mcore_writes_our_model_directory(exports):
    assert sorted(os.listdir(exports[0] / "moe_mcore")) == ["hf", "model", "swift_megatron.json"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_lora_tensors_convert_to_the_original_peft_adapter(run, exports, kind):
    """Saved with TP=2 (dense: gate/up rows interleaved per rank) or EP=2 (MoE): A copied to
    each projection of a fused linear and B's rows split give back the adapter bit for bit."""
    from safetensors.torch import load_file

    original = load_file(os.path.join(run[0][f"peft_{kind}"], "adapter_model.safetensors"))
    converted = load_file(str(exports[0] / f"lora_{kind}_peft" / "adapter_model.safetensors"))
    assert sorted(converted) == sorted(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    config = json.loads((exports[0] / f"lora_{kind}_peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.05)


# ---- resolution (no weights loaded) -------------------------------------------------------

def fake_checkpoint(root, args, files=()):
    """An ms-swift checkpoint directory skeleton: args.json, latest file, iter_0000001/."""
    os.makedirs(root / "iter_0000001")
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (root / "args.json").write_text(json.dumps(args))
    for name in files:
        (root / name).write_text("{}")
    return str(root)


def test_an_iteration_directory_finds_args_json_in_its_parent(tmp_path):
    path = fake_checkpoint(tmp_path / "ckpt", {"model": "Qwen/Qwen3-8B", "tuner_type": "full"})
    checkpoint = read_ms_swift_checkpoint(os.path.join(path, "iter_0000001"))
    assert checkpoint.directory == path and checkpoint.base_model == "Qwen/Qwen3-8B"
    assert is_ms_swift_checkpoint(path) and not is_ms_swift_checkpoint(str(tmp_path))


def test_only_safetensors_beside_an_empty_iteration_load_as_hf(tmp_path, tiny_model_dir):
    """ms-swift with save_safetensors and no optimizer writes only common.pt into iter_*/."""
    path = fake_checkpoint(tmp_path / "ckpt", {"model": "x", "tuner_type": "full"})
    for name in os.listdir(tiny_model_dir("qwen3")):
        shutil.copy(os.path.join(tiny_model_dir("qwen3"), name), path)
    source = sources.mcore_source(path)
    assert (source.kind, source.path, source.hf_files) == ("hf", path, path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(UserError, match="holds no weights"):
        sources.mcore_source(path)


def test_a_lora_checkpoint_is_never_read_as_a_full_model(tmp_path):
    path = fake_checkpoint(tmp_path / "lora", {"model": "m", "tuner_type": "lora"},
                           files=["adapter_config.json", "adapter_model.safetensors"])
    with pytest.raises(UserError, match="pass it as --mcore_adapter"):
        sources.mcore_source(path)
    adapter = sources.adapter_source(path, "--mcore_adapter")
    assert (adapter.peft_dir, adapter.base_model) == (path, "m")
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(UserError, match="neither its PEFT files"):
        sources.adapter_source(path, "--mcore_adapter")


# ---- megatron rlhf starting from them -----------------------------------------------------

def first_steps(tmp_path, math_dataset_path, starts):
    """Step 1's logged metrics and output of a one-step `megatron rlhf` run starting from each
    name's flags in `starts`, all run at once: {name: (metrics, stdout + stderr)}."""
    plugin = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")
    common = ["--dataset", math_dataset_path, "--external_plugins", plugin,
              "--reward_funcs", "digit_ratio", "contains_answer",
              "--num_generations", "4", "--global_batch_size", "16", "--micro_batch_size", "4",
              "--max_completion_length", "16", "--beta", "0.1", "--lr", "1e-3", "--train_iters",
              "1", "--report_to", "none", "--add_version", "false", "--save_safetensors", "false"]
    procs = run_cli_together([(["rlhf", *start, *common, "--output_dir", tmp_path / name], {})
                              for name, start in starts.items()])
    result = {}
    for name, proc in zip(starts, procs):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        result[name] = (json.loads(open(tmp_path / name / "logging.jsonl").readline()),
                        proc.stdout + proc.stderr)
    return result


@pytest.mark.slow
def test_rlhf_starts_from_ms_swift_checkpoints(run, models, math_dataset_path, tmp_path):
    """--mcore_model of an ms-swift full checkpoint (no --model: its args.json names the base)
    trains exactly as --model of the HF weights it holds; --mcore_adapter of an ms-swift LoRA
    checkpoint (adapter tensors only, converted at load time) exactly as the PEFT adapter it was
    written from."""
    ckpt, keys = run[0], ("loss/policy", "grad_norm", "reward/mean", "kl", "entropy")

    def same(a, b):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key

    peft_dir = tmp_path / "peft_dense"   # the adapter with the checkpoint's dropout (args.json)
    shutil.copytree(ckpt["peft_dense"], peft_dir)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    (peft_dir / "adapter_config.json").write_text(json.dumps(dict(config, lora_dropout=0.05)))
    runs = first_steps(tmp_path, math_dataset_path, {
        "hf": ["--model", models["dense"]], "swift": ["--mcore_model", ckpt["dense"]],
        "peft": ["--model", models["dense"], "--adapters", peft_dir],
        "lora": ["--model", models["dense"], "--mcore_adapter", ckpt["lora_dense"]]})
    (hf, _), (swift, _), (peft, _), (lora, log) = (runs[name] for name in
                                                   ("hf", "swift", "peft", "lora"))
    same(swift, hf)
    assert hf["grad_norm"] > 0
    same(lora, peft)
    assert "--train_type lora" in log
