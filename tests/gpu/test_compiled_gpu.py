"""GPU: each decoder layer's lean autograd node (RMSNorm, SwiGLU, packed RoPE;
model/activations.py, model/rope.py) with its functions compiled by torch.compile (the default
on CUDA: Triton kernels) against the same node run eagerly, at Qwen2.5-1.5B widths in bf16:
values and input / weight gradients no further from a float64 evaluation than eager's, and the
compiled kernels really ran.

    python -m pytest tests/gpu/test_compiled_gpu.py -q -s

The CPU counterpart is tests/unit/test_compiled.py (Inductor's CPU backend). Passed on an H200
(docs/gpu.md, sixteenth session).
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
