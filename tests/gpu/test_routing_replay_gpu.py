"""GPU: routing replay (--router_replay_mode R3) with vLLM's routed experts, on the Qwen3-30B-A3B
layer shape (`qwen3-moe-4l`: 4 layers, 64 experts, top 8; random bf16 weights), set up as one
training process: the Megatron policy (bf16, its router in fp32) pushes its weights into the
colocated vLLM engine started with `enable_return_routed_experts`, which generates 32
completions; every completion carries [prompt + completion - 1, layers, top_k] routes of real
experts, and replaying them brings the trainer's logprobs of the completions closer to vLLM's
than the trainer's own routing. One JSON line with both mean gaps (run with -s).

    python -m pytest tests/gpu/test_routing_replay_gpu.py -q -s   # vLLM (>= 0.26), one GPU
"""
import json
import os
import sys
from functools import partial

import pytest
import torch

from tests.distributed.launch import REPO

pytestmark = pytest.mark.gpu
PROMPTS, PROMPT_LEN, MAX_TOKENS = 32, 64, 128


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from grpo_step import build_model

    from swift_megatron.parallel.state import ParallelState

    model_dir = build_model("qwen3-moe-4l", str(tmp_path_factory.mktemp("moe")), "bfloat16",
                            "cuda")
    state = ParallelState.initialize(device="cuda", seed=0)
    yield model_dir, state
    ParallelState.destroy()


def test_r3_replay_closes_the_engine_trainer_gap(setup):
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.model.routing_replay import without_routes
    from swift_megatron.rlhf.grpo import components
    from swift_megatron.rlhf.grpo.batch import Sample, split_micro_batches, to_device
    from swift_megatron.rlhf.grpo.objective import collect_logprobs
    from swift_megatron.rollout.engine import SamplingConfig
    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings
    from swift_megatron.training.step import forward_backward
    from tests.distributed.workers import routing_replay as worker

    model_dir, state = setup
    hf_config = load_hf_config(model_dir)
    args = worker.flags(model_dir)    # --router_replay_mode R3
    chunks, _, bridge = components._load_model(args, state, model_dir, hf_config,
                                               torch.bfloat16, None)
    engine = ColocateEngine(ColocateSettings(model_dir, dtype="bfloat16", max_model_len=512,
                                             gpu_memory_utilization=0.3, routed_experts=True),
                            eos_token_ids=[hf_config.get("eos_token_id", 2)])
    try:
        engine.update_weights(bridge.export(chunks))
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, 400, (PROMPTS, PROMPT_LEN), generator=gen).tolist()
        completions = engine.generate(prompts, SamplingConfig(max_tokens=MAX_TOKENS),
                                      seeds=list(range(PROMPTS)))
    finally:
        engine.close()
    layers, experts, top_k = (hf_config["num_hidden_layers"], hf_config["num_experts"],
                              hf_config["num_experts_per_tok"])
    samples = [Sample(group_id=i, prompt_id=i, prompt_ids=p, completion_ids=c.token_ids,
                      rollout_logprobs=c.logprobs, finish_reason=c.finish_reason, rewards=[],
                      routed_experts=c.routed_experts) for i, (p, c) in
               enumerate(zip(prompts, completions))]
    for sample in samples:
        routes = torch.as_tensor(sample.routed_experts).long()
        assert routes.shape[0] in (PROMPT_LEN + len(sample.completion_ids) - 1,
                                   PROMPT_LEN + len(sample.completion_ids))
        assert routes.shape[1:] == (layers, top_k)
        assert 0 <= int(routes.min()) and int(routes.max()) < experts
        assert bool((routes.sort(-1).values.diff(dim=-1) > 0).all())   # distinct per token
    micro = [to_device(mb, state.device) for mb in split_micro_batches(samples, 8, pad_id=0,
                                                                      packed=True)]
    settings = worker.settings(bridge)

    def mean_gap(batches):
        outputs = forward_backward(chunks, batches, partial(collect_logprobs, settings), True)
        gap = sum(float(((out["logprobs"] - mb["rollout_logprobs"]).abs()
                         * mb["completion_mask"]).sum()) for out, mb in zip(outputs, batches))
        return gap / sum(float(mb["completion_mask"].sum()) for mb in batches)

    replayed = mean_gap(micro)
    own = mean_gap([without_routes(mb) for mb in micro])
    print(json.dumps({"name": "routing_replay_gap", "preset": "qwen3-moe-4l",
                      "gap_own_routing": own, "gap_replayed": replayed}))
    assert replayed < own
