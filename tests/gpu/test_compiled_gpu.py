"""GPU: each decoder layer's elementwise math compiled by torch.compile (model/compiled.py, the
default on CUDA: Triton kernels) against the same functions run eagerly, at Qwen2.5-1.5B widths
in bf16: values and input gradients no further from a float64 evaluation than eager's (Inductor
rounds once where eager rounds after each op), and the compiled kernels really ran.

    python -m pytest tests/gpu/test_compiled_gpu.py -q -s

The CPU counterpart is tests/unit/test_compiled.py (Inductor's CPU backend). Not yet run on a GPU.
"""
import pytest
import torch

from swift_megatron.model import activations, rope

pytestmark = pytest.mark.gpu
TOKENS, HIDDEN, FFN, HEADS, HEAD_DIM = 4096, 1536, 8960, 12, 128


def _cases():
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    cu = torch.tensor([0, 1000, 2500, TOKENS], device="cuda")
    freqs = torch.rand(TOKENS, 1, 1, HEAD_DIM, device="cuda", generator=gen) * 100
    return [(activations.MATH, "rms_norm", [randn(TOKENS, HIDDEN), 1 + 0.1 * randn(HIDDEN)],
             (1e-6,)),
            (activations.MATH, "zero_centered_rms_norm",
             [randn(TOKENS, HIDDEN), 0.1 * randn(HIDDEN)], (1e-6,)),
            (activations.MATH, "swiglu", [randn(TOKENS, 2 * FFN)], ()),
            (rope.MATH, "rotate", [randn(TOKENS, 1, HEADS, HEAD_DIM)],
             rope.rotary_tables(cu, freqs, TOKENS, torch.bfloat16))]


def _run(fn, tensors, rest, dtype, upstream):
    leaves = [t.detach().to(dtype, copy=True).requires_grad_(True) for t in tensors]
    rest = tuple(r.to(dtype) if torch.is_tensor(r) else r for r in rest)
    out = fn(*leaves, *rest)
    out.backward(upstream.to(out.dtype))
    return out.double(), [t.grad.double() for t in leaves]


@pytest.mark.parametrize("index", range(4))
def test_compiled_layer_math_is_no_less_exact_than_eager(index):
    group, name, tensors, rest = _cases()[index]
    assert group.active(torch.device("cuda"))
    tensors = [t.bfloat16() for t in tensors]
    exact_tensors = [t.double() for t in tensors]   # the same bf16 inputs
    with torch.no_grad():
        shape = group.eager[name](*exact_tensors, *rest).shape
    upstream = torch.randn(shape, device="cuda", dtype=torch.float64)
    exact, exact_grads = _run(group.eager[name], exact_tensors, rest, torch.float64, upstream)
    eager, eager_grads = _run(group.eager[name], tensors, rest, torch.bfloat16, upstream)
    compiled, compiled_grads = _run(lambda *a: group.run(name, a[0].device, *a), tensors, rest,
                                    torch.bfloat16, upstream)
    assert group.ran_compiled
    error = dict(eager=(eager - exact).abs().max().item(),
                 compiled=(compiled - exact).abs().max().item())
    print(name, "max |error| against float64:", error)
    assert error["compiled"] <= 1.5 * error["eager"] + 1e-6
    for e, c, x in zip(eager_grads, compiled_grads, exact_grads):
        assert (c - x).abs().max() <= 1.5 * (e - x).abs().max() + 1e-6
