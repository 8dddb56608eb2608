"""GPU: each decoder layer's lean autograd node (RMSNorm, SwiGLU, packed RoPE;
model/activations.py, model/rope.py) with its functions compiled by torch.compile (the default
on CUDA: Triton kernels) against the same node run eagerly, at Qwen2.5-1.5B widths in bf16:
values and input / weight gradients no further from a float64 evaluation than eager's, and the
compiled kernels really ran.

    python -m pytest tests/gpu/test_compiled_gpu.py -q -s

The CPU counterpart is tests/unit/test_compiled.py (Inductor's CPU backend). Passed on an H200
(2026-11-27).
"""
import pytest
import torch

from swift_megatron.model import activations, rope

pytestmark = pytest.mark.gpu
TOKENS, HIDDEN, FFN, HEADS, HEAD_DIM = 4096, 1536, 8960, 12, 128
GROUPS = (activations.MATH, rope.MATH)


def _cases():
    """(name, node, differentiable bf16 inputs, other arguments as functions of the dtype)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    cu = torch.tensor([0, 1000, 2500, TOKENS], device="cuda")
    freqs = torch.rand(TOKENS, 1, 1, HEAD_DIM, device="cuda", generator=gen) * 100
    tables = rope.rotary_tables(cu, freqs, TOKENS, torch.bfloat16)
    return [("rms_norm", activations.RMSNormFn.apply,
             [randn(TOKENS, HIDDEN), 1 + 0.1 * randn(HIDDEN)], lambda dtype: (1e-6, "rms_norm")),
            ("zero_centered_rms_norm", activations.RMSNormFn.apply,
             [randn(TOKENS, HIDDEN), 0.1 * randn(HIDDEN)],
             lambda dtype: (1e-6, "zero_centered_rms_norm")),
            ("swiglu", activations.SwiGLUFn.apply, [randn(TOKENS, 2 * FFN)], lambda dtype: ()),
            ("rotate", rope.RotateFn.apply, [randn(TOKENS, 1, HEADS, HEAD_DIM)],
             lambda dtype: tuple(t.to(dtype) for t in tables))]


def _run(node, tensors, rest, dtype, upstream):
    leaves = [t.detach().to(dtype, copy=True).requires_grad_(True) for t in tensors]
    out = node(*leaves, *rest(dtype))
    out.backward(upstream.to(out.dtype))
    return [out.double()] + [t.grad.double() for t in leaves]


@pytest.mark.parametrize("index", range(4))
def test_compiled_nodes_are_no_less_exact_than_eager(index):
    name, node, tensors, rest = _cases()[index]
    upstream = torch.randn(node(*tensors, *rest(torch.bfloat16)).shape, device="cuda",
                           dtype=torch.float64)
    try:
        results = {}
        for mode, dtype in (("exact", torch.float64), ("eager", torch.bfloat16),
                            ("compiled", torch.bfloat16)):
            for group in GROUPS:
                group.set_mode(mode == "compiled")
            results[mode] = _run(node, tensors, rest, dtype, upstream)
        assert all(group.ran_compiled for group in GROUPS if name in group.eager)
    finally:
        for group in GROUPS:
            group.set_mode("auto")
    errors = {mode: [(a - b).abs().max().item() for a, b in zip(results[mode], results["exact"])]
              for mode in ("eager", "compiled")}
    print(name, "max |error| against float64 (value, gradients):", errors)
    for compiled, eager in zip(errors["compiled"], errors["eager"]):
        assert compiled <= 1.5 * eager + 1e-6


def test_qwen3_5_stack_runs_compiled_with_the_defaults():
    """The Qwen3.5 hybrid stack (the 9B layer shape, 4 layers: three Gated DeltaNet through fla,
    whose gated output norm megatron-core compiles itself, then gated full attention) in bf16
    on CUDA with the defaults (issue 39: its first training step failed there): the forward and
    backward of a packed micro-batch run with the layer math compiled, and give the eager
    stack's logits and gradients within bf16 noise."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from swift_megatron.fixtures.models import tiny_hf_config
    from swift_megatron.fixtures.shapes import REAL_SHAPES
    from swift_megatron.model.build import build_model
    from swift_megatron.parallel.state import ParallelState

    shape = {k: v for k, v in REAL_SHAPES["qwen3.5-9b-4l"].items() if k != "model_type"}
    hf = tiny_hf_config("qwen3_5", **dict(shape, vocab_size=4096)).text_config.to_dict()
    ParallelState.initialize(device="cuda", seed=0)
    try:
        model, _, _ = build_model(hf, torch.bfloat16, torch.device("cuda"))
        cu = torch.tensor([0, 700, 1500, 2048], dtype=torch.int32, device="cuda")
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=800, max_seqlen_kv=800)
        tokens = torch.randint(0, 4096, (1, 2048), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(1))
        positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])]).cuda()
        results = {}
        for mode in ("eager", "auto"):
            for group in GROUPS:
                group.set_mode(False if mode == "eager" else "auto")
            model.zero_grad()
            logits = model(tokens, positions.unsqueeze(0), None, packed_seq_params=params)
            logits.float().logsumexp(-1).mean().backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters()
                               if p.grad is not None])
            results[mode] = (logits.float(), grads)
        assert activations.MATH.ran_compiled and rope.MATH.ran_compiled
    finally:
        for group in GROUPS:
            group.set_mode("auto")
        ParallelState.destroy()
    (eager, eager_grads), (compiled, compiled_grads) = results["eager"], results["auto"]
    assert torch.isfinite(compiled).all() and torch.isfinite(compiled_grads).all()
    value_gap = (compiled - eager).abs().mean() / eager.std()
    grad_gap = (compiled_grads - eager_grads).norm() / eager_grads.norm()
    print("qwen3.5 compiled vs eager: mean |logit gap| / logit std", value_gap.item(),
          "gradient relative gap", grad_gap.item())
    assert value_gap < 0.02 and grad_gap < 0.05
