"""The bridge end to end on tiny checkpoints of every family (workers/bridge_layouts.py).

Single process (one worker run for all families): HF -> Megatron -> HF is bit-exact for every
tensor (Qwen3.5's vision tower and MTP tensors, outside the Megatron model, copied through), Megatron logits match transformers in float32, the exported checkpoint reloads in
transformers and greedy-generates the same tokens, a small --max_shard_size writes an index.

Two processes over gloo (slow; one worker run, one layout per job): loading with TP=2 (llama,
qwen2: vocab 505 so TP pads it), PP=2 (qwen3, tied embeddings across stages), EP=2, TP=2 x EP=2
x ETP=1 and TP=2 x ETP=2 (qwen3_moe), TP=2 (with and without sequence parallelism) and PP=2
(qwen3_5: Gated DeltaNet and gated attention split over ranks, linear and full layers on
different stages), PP=2 split unevenly (qwen3 as 3 + 1 layers, qwen3_5 as 1 + 3), TP=2 x EP=2 +
SP (qwen3_5_moe) exports bit-for-bit the original tensors and
matches transformers' logits; a Megatron model directory saved with TP=2 reloads with PP=2 and
with 1x1 and gives identical logits; with the interleaved pipeline (PP=2 x VPP=2, qwen3: tied
embeddings) the bridge loads and exports the model chunks bit for bit, the logits match
transformers, and a model directory saved from the chunks reloads into them. Also the GPU bf16
worker (tests/gpu/test_bridge_gpu.py) on its tiny CPU preset.

    python -m pytest tests/distributed/test_bridge_layouts.py -q            # everything (~1 min)
    python -m pytest tests/distributed/test_bridge_layouts.py -q -m "not slow"
"""
import json
import os

import pytest
import torch

from swift_megatron.fixtures import FAMILIES, build_tiny_model, load_tokenizer
from tests.distributed.launch import run_workers
from tests.helpers import safetensors_of
from tests.gpu.test_bridge_gpu import check_logits_report

PADDED_VOCAB_FAMILIES = ("llama", "qwen2")  # vocab 505: not divisible by TP=2
ATOL = 1e-4
SHARDED = "qwen3"  # exported with a small max_shard_size


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge_models")
    overrides = {family: {"vocab_size": 505} for family in PADDED_VOCAB_FAMILIES}
    return {family: build_tiny_model(family, str(root / family), **overrides.get(family, {}))
            for family in FAMILIES}


def run_jobs(jobs, nproc, out_dir):
    path = os.path.join(out_dir, "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    return run_workers("bridge_layouts.py", nproc, out_dir, ["--jobs", path])


def logits_of(out_dir, job):
    return torch.load(os.path.join(out_dir, f"{job}.logits.pt"))


def assert_exported_exactly(result):
    assert result["export"]["mismatched"] == []
    assert result["export"]["missing"] == []
    assert result["export"]["duplicates"] == 0


# ---- single process -------------------------------------------------------------------------

def text_only_saves(vl_dir, root):
    """Qwen3.5's text stack saved on its own: as transformers' Qwen3_5ForCausalLM writes it
    (model_type qwen3_5_text, tensors still under model.language_model.) and with the text
    stack under model. (as other tools write text-only checkpoints)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    text, plain = str(root / "qwen3_5_text"), str(root / "qwen3_5_plain")
    AutoModelForCausalLM.from_pretrained(vl_dir).save_pretrained(text)
    shutil.copytree(text, plain)
    tensors = load_file(os.path.join(text, "model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()},
              os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    return {"qwen3_5_text": text, "qwen3_5_plain": plain}


TEXT_ONLY = ("qwen3_5_text", "qwen3_5_plain")
HYBRID = ("qwen3_5", "qwen3_5_moe")
LONG = 200  # tokens: the Gated DeltaNet rule's state carried over 4 chunks of 64


@pytest.fixture(scope="module")
def single(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_single")
    jobs = [dict(name=family, hf_dir=models[family], load="hf", logits=True, precision=True,
                 save_hf=str(out / f"{family}_hf"),
                 max_shard_size="40KB" if family == SHARDED else "5GB",
                 long_precision=LONG if family in HYBRID else None) for family in FAMILIES]
    jobs += [dict(name=name, hf_dir=path, load="hf", precision=True)
             for name, path in text_only_saves(models["qwen3_5"], out).items()]
    return out, run_jobs(jobs, 1, out)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(single, models, family):
    out, results = single
    assert_exported_exactly(results[family])
    assert (results[family]["export"]["passthrough"] > 0) == family.startswith("qwen3_5")
    original, exported = safetensors_of(models[family]), safetensors_of(out / f"{family}_hf")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES + TEXT_ONLY)
def test_logits_match_transformers(single, family):
    report = single[1][family]["precision"]
    print(f"{family}: {json.dumps(report)}")
    assert report["max_abs_diff"] <= ATOL
    assert report["argmax_agreement"] == 1.0


@pytest.mark.parametrize("family", HYBRID)
def test_gated_deltanet_logits_match_over_several_chunks(single, family):
    report = single[1][family]["long_precision"]
    print(f"{family} ({LONG} tokens): {json.dumps(report)}")
    assert report["num_tokens"] == 4 * LONG and report["max_abs_diff"] <= ATOL


def greedy_tokens(model_dir, prompt_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    return out[0, prompt_ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_checkpoint_generates_like_the_original(single, models, family):
    tokenizer = load_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, return_tensors="pt").input_ids
    expected = greedy_tokens(models[family], prompt)
    assert greedy_tokens(single[0] / f"{family}_hf", prompt) == expected
    assert len(expected) == 8


def test_small_max_shard_size_writes_an_index(single, models):
    exported = single[0] / f"{SHARDED}_hf"
    with open(exported / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(p.name for p in exported.glob("*.safetensors"))
    assert len(shards) > 1 and set(weight_map.values()) == set(shards)
    assert sorted(weight_map) == sorted(safetensors_of(models[SHARDED]))
    assert not (exported / "model.safetensors").exists()


# ---- two processes --------------------------------------------------------------------------

# One job per layout; "from_tp2_dir" loads the model directory the first job saves with TP=2.
LAYOUTS = [
    dict(name="llama_tp2", family="llama", tp=2, logits=True, precision=True, save_tp2_dir=True),
    dict(name="llama_pp2_from_tp2_dir", family="llama", from_tp2_dir=True, pp=2, logits=True,
         precision=True),
    dict(name="llama_1x1_from_tp2_dir", family="llama", from_tp2_dir=True, logits=True),
    dict(name="qwen2_tp2", family="qwen2", tp=2, precision=True),
    dict(name="qwen3_pp2", family="qwen3", pp=2, precision=True),
    dict(name="qwen3_moe_ep2", family="qwen3_moe", ep=2, precision=True),
    dict(name="qwen3_moe_tp2_ep2_etp1", family="qwen3_moe", tp=2, ep=2, etp=1, precision=True),
    dict(name="qwen3_moe_tp2_etp2", family="qwen3_moe", tp=2, etp=2, precision=True),
    dict(name="qwen3_5_tp2", family="qwen3_5", tp=2, precision=True),
    dict(name="qwen3_5_tp2_sp", family="qwen3_5", tp=2, sp=True, precision=True),
    dict(name="qwen3_5_pp2", family="qwen3_5", pp=2, precision=True),
    # uneven pipeline splits of the 4 layers: 3 + 1, and 1 + 3 (Qwen3.5: Gated DeltaNet layers
    # 0-2 and the full-attention layer 3; the last stage holds both kinds)
    dict(name="qwen3_pp2_first3", family="qwen3", pp=2, first=3, precision=True,
         stage_layers=[3, 1]),
    dict(name="qwen3_5_pp2_last3", family="qwen3_5", pp=2, last=3, precision=True,
         stage_layers=[1, 3]),
    dict(name="qwen3_5_moe_tp2_ep2_sp", family="qwen3_5_moe", tp=2, ep=2, etp=1, sp=True,
         precision=True),
]
PRECISION_LAYOUTS = [job["name"] for job in LAYOUTS if job.get("precision")]


def worker_job(job, models, tp2_dir):
    job = dict(job, hf_dir=models[job["family"]])
    job.pop("stage_layers", None)
    job["load"] = tp2_dir if job.pop("from_tp2_dir", False) else "hf"
    if job.pop("save_tp2_dir", False):
        job["save_model_dir"] = tp2_dir
    return job


@pytest.fixture(scope="module")
def layouts(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_layouts")
    tp2_dir = str(out / "llama_tp2_model_dir")
    return out, run_jobs([worker_job(job, models, tp2_dir) for job in LAYOUTS], 2, out)


@pytest.mark.slow
@pytest.mark.parametrize("job", [job["name"] for job in LAYOUTS])
def test_layout_exports_the_original_tensors(layouts, job):
    for rank in layouts[1]:  # every rank receives every tensor
        assert_exported_exactly(rank[job])
    split = next(j for j in LAYOUTS if j["name"] == job).get("stage_layers")
    if split:   # each stage holds its share of the uneven split
        assert [rank[job]["layers"] for rank in layouts[1]] == split


@pytest.mark.slow
@pytest.mark.parametrize("job", PRECISION_LAYOUTS)
def test_layout_logits_match_transformers(layouts, job):
    report = layouts[1][0][job]["precision"]
    print(f"{job}: {json.dumps(report)}")
    assert report["max_abs_diff"] <= ATOL
    assert report["argmax_agreement"] == 1.0


@pytest.mark.slow
def test_model_dir_saved_with_tp2_reloads_in_other_layouts(layouts, single):
    out = layouts[0]
    reference = logits_of(single[0], "llama")  # 1x1, loaded from HF
    assert torch.equal(logits_of(out, "llama_1x1_from_tp2_dir"), reference)
    assert torch.equal(logits_of(out, "llama_pp2_from_tp2_dir"), reference)
    torch.testing.assert_close(logits_of(out, "llama_tp2"), reference, atol=1e-5, rtol=0)
    with open(out / "llama_tp2_model_dir" / "swift_megatron.json") as f:
        assert json.load(f)["saved_with"] == {"tp": 2, "pp": 1, "ep": 1, "etp": 1}


@pytest.mark.slow
def test_interleaved_pipeline_chunks_round_trip(models, tmp_path):
    ranks = run_workers("bridge_vpp.py", 2, tmp_path, ["--hf_dir", models["qwen3"]])
    for rank in ranks:
        assert rank["chunks"] == 2
        assert_exported_exactly(rank)
        assert_exported_exactly({"export": rank["reloaded_export"]})
        assert rank["export"]["exported"] == len(safetensors_of(models["qwen3"]))
        assert rank["logits_max_diff"] <= ATOL


@pytest.mark.slow
def test_gpu_logits_worker_runs_on_cpu(tmp_path):
    report = run_workers("bridge_bf16_logits.py", 2, tmp_path,
                         ["--preset", "tiny_qwen3_moe", "--device", "cpu", "--tp", 2])[0]
    print(json.dumps(report))
    check_logits_report(report)
