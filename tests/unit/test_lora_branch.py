"""lora/branch.py: the one-node adapter branch, and the whole frozen linear with its adapters as
one node, against the same math as plain torch ops, values and gradients, and torch's numerical
gradient check (float64)."""
import pytest
import torch

from swift_megatron.lora.branch import AdapterBranch, AdapterLayout, FrozenLinearWithAdapter

R, IN, SCALE = 2, 5, 1.5


def fused_case(dtype=torch.float64):
    """Three adapters interleaved in a fused output of 10 rows (as mcore's q/k/v groups), two
    rows no adapter covers."""
    gen = torch.Generator().manual_seed(0)
    positions = [torch.tensor([0, 1, 5, 6]), torch.tensor([2, 7]), torch.tensor([3, 8])]
    layout = AdapterLayout(10, torch.cat(positions),
                           torch.arange(3).repeat_interleave(torch.tensor([4, 2, 2])))
    a_s = [torch.randn(R, IN, generator=gen, dtype=dtype) for _ in positions]
    b_s = [torch.randn(len(p), R, generator=gen, dtype=dtype) for p in positions]
    return layout, positions, a_s, b_s


def plain(output, x, positions, a_s, b_s):
    """output + SCALE * B_i A_i x at projection i's rows, one projection at a time."""
    delta = torch.zeros_like(output)
    for rows, a, b in zip(positions, a_s, b_s):
        delta = delta.index_add(-1, rows, x @ a.t() @ b.t())
    return output + SCALE * delta


def leaves(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("in_place", [True, False])
def test_fused_adapters_equal_the_plain_ops_values_and_gradients(in_place):
    layout, positions, a_s, b_s = fused_case()
    gen = torch.Generator().manual_seed(1)
    output0 = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)
    x0 = torch.randn(3, 4, IN, generator=gen, dtype=torch.float64)
    upstream = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)

    out_base, x, *params = leaves(output0, x0, *a_s, *b_s)
    ours = AdapterBranch.apply(out_base * 1.0, x, layout, SCALE, in_place, *params)
    ours.backward(upstream)
    ref_base, ref_x, *ref_params = leaves(output0, x0, *a_s, *b_s)
    ref = plain(ref_base, ref_x, positions, ref_params[:3], ref_params[3:])
    ref.backward(upstream)

    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip([out_base, x, *params], [ref_base, ref_x, *ref_params]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    # rows no adapter covers are left as they were
    torch.testing.assert_close(ours[..., [4, 9]], output0[..., [4, 9]], rtol=0, atol=0)


def test_numerical_gradients_fused_and_single():
    layout, _, a_s, b_s = fused_case()
    gen = torch.Generator().manual_seed(2)
    output, x = leaves(torch.randn(6, 10, generator=gen, dtype=torch.float64),
                       torch.randn(6, IN, generator=gen, dtype=torch.float64))
    params = leaves(*a_s, *b_s)
    assert torch.autograd.gradcheck(
        lambda o, x, *p: AdapterBranch.apply(o, x, layout, SCALE, False, *p),
        (output, x, *params))
    single = AdapterLayout(7, None, None)   # a row-parallel linear: one adapter, every row
    a, b = leaves(torch.randn(R, IN, generator=gen, dtype=torch.float64),
                  torch.randn(7, R, generator=gen, dtype=torch.float64))
    output = torch.randn(6, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda o, x, a, b: AdapterBranch.apply(o, x, single, SCALE, False, a, b),
        (output, x, a, b))


def test_an_input_that_needs_no_gradient_gets_none():
    layout, _, a_s, b_s = fused_case()
    params = leaves(*a_s, *b_s)
    x = torch.randn(4, IN, dtype=torch.float64)
    out = AdapterBranch.apply(torch.zeros(4, 10, dtype=torch.float64), x, layout, SCALE, True,
                              *params)
    out.sum().backward()
    assert x.grad is None and all(p.grad is not None for p in params)


def test_gradients_go_into_main_grad_buffers_under_ddp():
    """Parameters with megatron DDP's `main_grad` get their gradients added there (accumulating
    over micro-batches, as DDP's hook would) and no `.grad`; the sums equal the plain gradients."""
    layout, positions, a_s, b_s = fused_case()
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, IN, generator=gen, dtype=torch.float64) for _ in range(2)]
    upstreams = [torch.randn(4, 10, generator=gen, dtype=torch.float64) for _ in range(2)]

    params = leaves(*a_s, *b_s)
    start = [torch.full_like(p, 0.5) for p in params]
    for param, value in zip(params, start):
        param.main_grad = value.clone()
    for x, upstream in zip(xs, upstreams):
        AdapterBranch.apply(torch.zeros(4, 10, dtype=torch.float64), x, layout, SCALE, True,
                            *params).backward(upstream)
    ref = leaves(*a_s, *b_s)
    for x, upstream in zip(xs, upstreams):
        plain(torch.zeros(4, 10, dtype=torch.float64), x, positions, ref[:3], ref[3:]).backward(
            upstream)

    for param, value, want in zip(params, start, ref):
        assert param.grad is None
        torch.testing.assert_close(param.main_grad, value + want.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_frozen_linear_with_adapters_equals_the_plain_ops(with_bias, dropout):
    """x W^T + bias + adapters of x' (x' = x, or dropout(x) drawn inside the node with torch's
    native_dropout): values, the gradients of x (through both paths when dropped out) and of the
    adapters; W and the bias get none."""
    layout, positions, a_s, b_s = fused_case()
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(10, IN, generator=gen, dtype=torch.float64)
    bias = torch.randn(10, generator=gen, dtype=torch.float64) if with_bias else None
    x0 = torch.randn(3, 4, IN, generator=gen, dtype=torch.float64)
    upstream = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)
    torch.manual_seed(7)   # the node's draw, then the same draw for the reference's mask
    x, *params = leaves(x0, *a_s, *b_s)
    ours = FrozenLinearWithAdapter.apply(x, dropout, weight, bias, layout, SCALE, *params)
    ours.backward(upstream)
    torch.manual_seed(7)
    mask = torch.native_dropout(x0.reshape(-1, IN), dropout, True)[1].view_as(x0) \
        if dropout else torch.ones_like(x0, dtype=torch.bool)
    assert 0 < mask.sum() < mask.numel() or not dropout   # the case drops some inputs
    ref_x, *ref_params = leaves(x0, *a_s, *b_s)
    base = ref_x @ weight.t() + (bias if with_bias else 0.0)
    ref = plain(base, ref_x * mask / (1 - dropout), positions, ref_params[:3], ref_params[3:])
    ref.backward(upstream)

    assert ours.shape == (3, 4, 10)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip([x, *params], [ref_x, *ref_params]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)


def test_numerical_gradients_of_the_frozen_linear_with_adapters():
    layout, _, a_s, b_s = fused_case()
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(10, IN, generator=gen, dtype=torch.float64)
    bias = torch.randn(10, generator=gen, dtype=torch.float64)
    x, = leaves(torch.randn(6, IN, generator=gen, dtype=torch.float64))
    params = leaves(*a_s, *b_s)
    assert torch.autograd.gradcheck(
        lambda x, *p: FrozenLinearWithAdapter.apply(x, 0.0, weight, bias, layout, SCALE, *p),
        (x, *params))

    def dropped(x, *p):   # the same mask at every evaluation
        torch.manual_seed(3)
        return FrozenLinearWithAdapter.apply(x, 0.4, weight, None, layout, SCALE, *p)

    assert torch.autograd.gradcheck(dropped, (x, *params))
