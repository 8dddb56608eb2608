"""GPU: the Gated DeltaNet rule the Qwen3.5 stack runs on CUDA (fla's chunk_gated_delta_rule,
through model/gdn.py's dispatcher) against megatron-core's float32 torch rule it replaces, forward
and backward, at Qwen3.5-9B's linear-attention width (32 heads of 128), one packed sequence at a
time as PackedGatedDeltaNet calls it.

Each sequence length is new to the process, so the first call of each autotunes fla's Triton
kernels (their configurations are benchmarked on the call's own buffers); the same inputs then
run a second time. Both calls must match the reference: GPU runs of Qwen3.5 showed a grad norm
in the thousands once per run and never twice in a row (docs/gpu.md), which a kernel whose
autotuning writes into its outputs would explain.

    python -m pytest tests/gpu/test_gdn_gpu.py -q -s
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
HEADS, DIM = 32, 128
LENGTHS = (152, 777, 1500, 4100)   # the matrix's rows, odd lengths, past a 4096 boundary
TOLERANCE = 2e-2                   # bf16 inputs and kernels, relative to the largest entry


def _inputs(length: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = torch.nn.functional.normalize(randn(1, length, HEADS, DIM), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(1, length, HEADS, DIM), dim=-1).bfloat16()
    v = randn(1, length, HEADS, DIM).bfloat16()
    g = -torch.nn.functional.softplus(randn(1, length, HEADS) - 1.0)   # float32 log decays
    beta = torch.sigmoid(randn(1, length, HEADS)).bfloat16()
    upstream = randn(1, length, HEADS, DIM)
    return (q, k, v, g, beta), upstream


def _run(rule, inputs, upstream, dtype=None):
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_(True) for x in inputs]
    q, k, v, g, beta = leaves
    out, _ = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False)
    (out.float() * upstream).sum().backward()
    return [out.detach().float()] + [x.grad.float() for x in leaves]


def _worst(ours, reference):
    """The largest error of each tensor relative to its reference's largest entry."""
    return [((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
            for a, b in zip(ours, reference)]


@pytest.fixture(scope="module")
def rules():
    from megatron.core.ssm import gated_delta_net

    from swift_megatron.model import gdn

    if not gdn.uses_fla(torch.zeros(1, device="cuda")):
        pytest.skip("fla does not import here")
    return gdn.chunk_gated_delta_rule, gated_delta_net.torch_chunk_gated_delta_rule


@pytest.mark.parametrize("length", LENGTHS)
def test_first_and_second_calls_match_the_float32_rule(rules, length):
    ours, reference = rules
    inputs, upstream = _inputs(length, seed=length)
    expected = _run(reference, inputs, upstream, dtype=torch.float32)
    first = _run(ours, inputs, upstream)     # autotunes: a length this process has not seen
    second = _run(ours, inputs, upstream)
    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    print(f"\nT={length} first {dict(zip(names, map('{:.2e}'.format, _worst(first, expected))))}"
          f"\nT={length} second {dict(zip(names, map('{:.2e}'.format, _worst(second, expected))))}")
    for call, found in (("first", first), ("second", second)):
        for name, error in zip(names, _worst(found, expected)):
            assert error < TOLERANCE, f"{call} call, {name}: {error:.3g} of the largest entry"
