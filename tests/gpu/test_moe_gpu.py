"""GPU: grouped-GEMM experts (model/grouped_experts.py) and the device-side token dispatch
(model/moe_dispatch.py) in bfloat16 on CUDA:

- torch's grouped GEMM runs here in bfloat16 (so the grouped path, not the per-expert fallback,
  is what trains) and matches a float32 per-expert loop on token groups of uneven sizes, none a
  multiple of 8, some empty, at Qwen3-30B-A3B's expert widths (outputs and both gradients);
- a MoE layer of the tiny qwen3_moe and qwen3_5_moe, loaded through the bridge, gives the same
  output and gradients (input, router, experts, shared expert) with grouped experts as with
  SequentialMLP on the same input (within bfloat16 rounding);
- a MoE layer's forward and backward at one GPU makes no synchronising CUDA call
  (torch.cuda.set_sync_debug_mode("error")), while megatron's own dispatcher with SequentialMLP
  does;
- one MoE layer of Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top 8, expert ffn 768) on an
  8k-token micro-batch, grouped against sequential with the same weights: the outputs agree, and
  the forward + backward times are printed, also of SequentialMLP with megatron's dispatcher
  (not asserted; benchmarks/moe_layer.py measures the train step).

    python -m pytest tests/gpu/test_moe_gpu.py -q -s
"""
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
COUNTS = (13, 0, 301, 7, 0, 95, 1, 250)     # tokens per expert: uneven, empty groups
TOLERANCE = 2e-2                             # bf16, relative to the reference's largest entry


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).abs().max() /
            reference.float().abs().max().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def world():
    from swift_megatron.parallel.state import ParallelState

    yield ParallelState.initialize(device="cuda", seed=0)
    ParallelState.destroy()


def test_grouped_mm_runs_in_bf16_and_matches_a_float32_loop():
    from swift_megatron.model.grouped_experts import GroupedMM, grouped_mm_runs, per_expert_mm

    assert grouped_mm_runs("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor(COUNTS, device="cuda")
    for k, n in ((2048, 1536), (768, 2048)):    # fc1 and fc2 of Qwen3-30B-A3B's experts
        x = torch.randn(int(counts.sum()), k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(len(COUNTS), k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        upstream = torch.randn(x.shape[0], n, device="cuda", generator=gen).bfloat16()
        ours = [t.detach().requires_grad_() for t in (x, w)]
        reference = [t.detach().float().requires_grad_() for t in (x, w)]
        out = GroupedMM.apply(*ours, counts.cumsum(0).to(torch.int32))
        ref = per_expert_mm(*reference, counts)
        out.backward(upstream)
        ref.backward(upstream.float())
        assert _relative(out, ref) < TOLERANCE
        assert _relative(ours[0].grad, reference[0].grad) < TOLERANCE
        assert _relative(ours[1].grad, reference[1].grad) < TOLERANCE
        assert ours[1].grad[1].abs().max().item() == 0          # an empty group's weight


def _load(model_dir: str, grouped: bool):
    from swift_megatron.bridge import Bridge
    from swift_megatron.model.build import build_model
    from swift_megatron.model.config import load_hf_config

    hf = load_hf_config(model_dir)
    model, config, shape = build_model(hf, torch.bfloat16, torch.device("cuda"),
                                       moe_grouped_gemm=grouped)
    Bridge(hf, shape, config).load(model, model_dir)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_grouped_experts_match_sequential_mlp_in_bf16(world, tiny_model_dir, family):
    """One MoE layer on the same input (so the same routing), forward and backward."""
    from tests.helpers import per_expert_grads

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, 1, 64, device="cuda", generator=gen).bfloat16()
    upstream = torch.randn(256, 1, 64, device="cuda", generator=gen).bfloat16()
    results = []
    for grouped in (True, False):
        model = _load(tiny_model_dir(family), grouped)
        leaf = x.clone().requires_grad_()
        out, _ = model.decoder.layers[0].mlp(leaf)
        out.backward(upstream)
        results.append((out.detach(), leaf.grad, per_expert_grads(model)))
    (out, x_grad, grads), (ref_out, ref_x_grad, ref_grads) = results
    assert _relative(out, ref_out) < TOLERANCE
    assert _relative(x_grad, ref_x_grad) < TOLERANCE
    assert sorted(grads) == sorted(ref_grads)
    worst = max((_relative(grads[n], ref_grads[n]), n) for n in ref_grads)
    assert worst[0] < TOLERANCE, worst


def _moe_layer_pass(model, tokens: int):
    layer = model.decoder.layers[0].mlp
    x = torch.randn(tokens, 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    out, _ = layer(x)
    out.backward(torch.ones_like(out))
    return out


def test_a_moe_layer_never_synchronises_at_one_gpu(world, tiny_model_dir):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    model = _load(tiny_model_dir("qwen3_5_moe"), True)
    megatrons = _load(tiny_model_dir("qwen3_5_moe"), False)
    megatrons.decoder.layers[0].mlp.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
    _moe_layer_pass(model, 128)                  # compiles the SwiGLU kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _moe_layer_pass(model, 128)
        with pytest.raises(RuntimeError, match="synchronizing"):
            _moe_layer_pass(megatrons, 128)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _copy_weights(source, target) -> None:
    """target's parameters from source's, matched by the bridge's (per-expert) names."""
    from swift_megatron.bridge.load import bridge_parameters

    values = dict(bridge_parameters(source))
    with torch.no_grad():
        for name, param in bridge_parameters(target):
            param.copy_(values[name])


def _layer_time(model, tokens: int, repeats: int = 5) -> float:
    for _ in range(2):
        _moe_layer_pass(model, tokens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        _moe_layer_pass(model, tokens)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def test_qwen3_30b_a3b_layer_shape(world):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from swift_megatron.fixtures.shapes import REAL_SHAPES
    from swift_megatron.model.build import build_model

    hf = dict(REAL_SHAPES["qwen3-moe-small"], num_experts=128, num_hidden_layers=1,
              vocab_size=1024)
    grouped, _, _ = build_model(hf, torch.bfloat16, torch.device("cuda"), moe_grouped_gemm=True)
    sequential, _, _ = build_model(hf, torch.bfloat16, torch.device("cuda"),
                                   moe_grouped_gemm=False)
    _copy_weights(grouped, sequential)
    torch.manual_seed(3)
    x = torch.randn(8192, 1, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ours = grouped.decoder.layers[0].mlp(x)[0]
        reference = sequential.decoder.layers[0].mlp(x)[0]
    assert _relative(ours, reference) < TOLERANCE
    seconds = {name: _layer_time(model, 8192) for name, model in
               (("grouped", grouped), ("sequential", sequential))}
    sequential.decoder.layers[0].mlp.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
    seconds["megatron"] = _layer_time(sequential, 8192)
    print("Qwen3-30B-A3B MoE layer, 8192 tokens, forward + backward (ms): " + ", ".join(
        f"{name} {s * 1e3:.2f}" for name, s in seconds.items()) +
        f"; sequential / grouped {seconds['sequential'] / seconds['grouped']:.1f}x, "
        f"megatron's dispatcher / grouped {seconds['megatron'] / seconds['grouped']:.1f}x")
