"""What autograd saves for the backward per token, counted on the CPU around one decoder layer of
our spec at Qwen2.5-1.5B widths (bfloat16) and around the output layer + logprobs: every saved
tensor's storage once (views of one storage count once; parameters not). The counts stay under
bounds derived from the tensors a layer must keep (docs/gpu.md, "Activation memory per token"),
and the lean RMSNorm and SwiGLU nodes (model/activations.py) give the outputs of the plain ones bit
for bit and their gradients within bf16 rounding.

    python -m pytest tests/unit/test_activation_memory.py -q -s   # -s prints the breakdowns
"""
import collections

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.mlp import MLP

from swift_megatron.model.logprobs import head_logprobs

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 1536, 8960, 12, 2, 128   # Qwen2.5-1.5B
VOCAB = 4096
KV = KV_HEADS * HEAD_DIM
# bf16 values a layer keeps per token: the inputs of both norms, of linear_qkv, linear_fc1 and
# linear_proj, the rotated query, attention's output (on the CPU SDPA's per-sequence outputs and
# linear_proj's concatenated input: one hidden more than a GPU's single varlen output), the
# qkv output (q, k, v: the unrotated query lives in its storage) and the rotated key, the fc1
# output (gate, up) and fc2's input
LAYER_VALUES = 8 * HIDDEN + 3 * KV + 3 * FFN
# plus float32 logsumexp per head and the micro-batch's bf16 cos / sin tables (two per rotated
# tensor on megatron's padded path)
LAYER_BOUND = 2 * LAYER_VALUES + 4 * HEADS + 4 * 2 * HEAD_DIM
# final norm input, output layer input, the float32 logsumexp, int64 target: no logits (the
# head's logprobs recompute them in the backward, model/logprobs.py)
HEAD_BOUND = 2 * (2 * HIDDEN) + 4 + 8
LENGTHS = [64, 64]


@pytest.fixture(autouse=True)
def float32_cpu_backward_products(monkeypatch):
    """Megatron's linear backward (`grad_output.matmul(weight)`, `grad_output.t().matmul(input)`)
    multiplies in float32 and rounds to bfloat16 once, as torch's CPU bfloat16 GEMM accumulates.
    On CPUs without AVX-512 BF16 that GEMM runs 10-60x slower than float32 at these widths
    ([128, 17920] x [17920, 1536]: 14 s against 0.25 s), which was most of this file's time. The
    forward passes, where the saved bytes are counted, are untouched (they call torch.matmul)."""
    plain = torch.Tensor.matmul

    def matmul(a, b):
        if a.dtype == b.dtype == torch.bfloat16 and a.device.type == "cpu":
            return plain(a.float(), b.float()).to(torch.bfloat16)
        return plain(a, b)

    monkeypatch.setattr(torch.Tensor, "matmul", matmul)


@pytest.fixture(scope="module")
def model():
    from swift_megatron.model.build import build_model
    from swift_megatron.parallel.state import ParallelState

    ParallelState.initialize(device="cpu", seed=0)
    hf = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
              num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
              rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=256,
              tie_word_embeddings=True)
    model, _, _ = build_model(hf, torch.bfloat16, torch.device("cpu"))
    model.train()
    yield model
    ParallelState.destroy()


class SavedTensors:
    """saved_tensors_hooks that record each saved storage once, with the module whose forward
    saved it (forward hooks keep a stack of module names)."""

    def __init__(self, model):
        self.stack, self.saved, self.handles = [], {}, []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(
                lambda m, a, n=name: self.stack.append(n)))
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._pop()))

    def _pop(self):
        self.stack.pop()

    def _pack(self, t):
        storage = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and storage.data_ptr() not in self.saved:
            where = self.stack[-1] if self.stack else "loss"
            self.saved[storage.data_ptr()] = (storage.nbytes(), where, t.dtype, tuple(t.shape))
        return t

    def run(self, fn):
        self.saved.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                out = fn()
        finally:
            for handle in self.handles:
                handle.remove()
        return out

    def per_token(self, tokens: int) -> float:
        return sum(nbytes for nbytes, *_ in self.saved.values()) / tokens

    def breakdown(self, tokens: int) -> str:
        by_module = collections.Counter()
        for nbytes, where, *_ in self.saved.values():
            by_module[where.replace("decoder.layers.0.", "")] += nbytes / tokens
        return ", ".join(f"{name} {value:.0f}" for name, value in by_module.most_common())


def _packed():
    cu = torch.tensor([0] + LENGTHS, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_saved_bytes_per_token_per_layer(model, layout):
    layer, tokens = model.decoder.layers[0], sum(LENGTHS)
    torch.manual_seed(0)
    if layout == "packed":
        hidden = torch.randn(tokens, 1, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        kwargs = dict(rotary_pos_emb=model.rotary_pos_emb(max(LENGTHS), packed_seq=True),
                      packed_seq_params=_packed())
    else:
        hidden = torch.randn(max(LENGTHS), len(LENGTHS), HIDDEN, dtype=torch.bfloat16,
                             requires_grad=True)
        kwargs = dict(rotary_pos_emb=model.rotary_pos_emb(max(LENGTHS)))
    counter = SavedTensors(model)
    out, _ = counter.run(lambda: layer(hidden, attention_mask=None, **kwargs))
    per_token = counter.per_token(tokens)
    print(f"\n{layout}: {per_token:.0f} B/token/layer (bound {LAYER_BOUND}): "
          f"{counter.breakdown(tokens)}")
    assert per_token <= LAYER_BOUND
    assert all(dtype != torch.float32 or nbytes / tokens <= 4 * HEADS
               for nbytes, _, dtype, _ in counter.saved.values())   # no float32 activations
    out.float().square().mean().backward()
    assert torch.isfinite(hidden.grad).all()


def test_saved_bytes_per_token_of_the_head(model):
    tokens = sum(LENGTHS)
    torch.manual_seed(0)
    hidden = torch.randn(tokens, 1, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (tokens,))

    def head():
        return head_logprobs(model.decoder.final_layernorm(hidden)[:, 0],
                             model.shared_embedding_or_output_weight(), targets)

    counter = SavedTensors(model)
    counter.run(head)
    per_token = counter.per_token(tokens)
    print(f"\nhead: {per_token:.0f} B/token (bound {HEAD_BOUND}): {counter.breakdown(tokens)}")
    assert per_token <= HEAD_BOUND


def _outputs_and_grads(forward, inputs, params):
    for t in list(inputs) + list(params):
        t.grad = None
    out = forward(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    return [out.detach()] + [t.grad.clone() for t in list(inputs) + list(params)]


def _saved_per_token(forward, inputs, tokens):
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(*inputs)
    return sum(seen.values()) / tokens


def test_lean_norms_and_swiglu_equal_the_plain_ops(model):
    """Our modules (one autograd node each, model/activations.py) against the plain ops they
    replace (activations' forward functions under autograd, megatron's own MLP.forward): the
    same outputs bit for bit, input / weight gradients within bf16 rounding (ours are rounded
    once from float32), and what each keeps for the backward, before -> after."""
    from swift_megatron.model.activations import rms_norm, zero_centered_rms_norm
    from swift_megatron.model.spec import ZeroCenteredRMSNorm

    layer, tokens = model.decoder.layers[0], sum(LENGTHS)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(tokens, 1, HIDDEN, generator=gen) * 3).to(torch.bfloat16).requires_grad_()
    zero_centered = ZeroCenteredRMSNorm(layer.config, HIDDEN)
    cases = [("RMSNorm", layer.input_layernorm,
              lambda m: (lambda t: rms_norm(t, m.weight, m.eps))),
             ("ZeroCenteredRMSNorm", zero_centered,
              lambda m: (lambda t: zero_centered_rms_norm(t, m.weight, m.eps))),
             ("SwiGLUMLP", layer.mlp, lambda m: (lambda t: MLP.forward(m, t)))]
    with torch.no_grad():
        for _, module, _ in cases[:2]:
            module.weight.add_(torch.randn(HIDDEN, generator=gen).to(torch.bfloat16) * 0.1)
    for name, module, plain in cases:
        params = list(module.parameters())
        ours = _outputs_and_grads(module, [x], params)
        ref = _outputs_and_grads(plain(module), [x], params)
        assert torch.equal(ours[0], ref[0]), name
        for a, b in zip(ours[1:], ref[1:]):
            torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02, msg=name)
        before = _saved_per_token(plain(module), [x], tokens)
        after = _saved_per_token(module, [x], tokens)
        print(f"\n{name}: {before:.0f} -> {after:.0f} B/token saved")
        assert after < before


class _FlaSaves(torch.autograd.Function):
    """fla's chunk_gated_delta_rule as the memory sees it (the CPU runs megatron's torch rule,
    which keeps its own intermediates): the output, and q, k, v, g, beta and A ([.., heads, 64],
    bf16) kept for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        from megatron.core.ssm import gated_delta_net

        with torch.no_grad():
            out, _ = gated_delta_net.torch_chunk_gated_delta_rule(
                q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False)
        ctx.save_for_backward(q, k, v, g, beta, q.new_empty(*q.shape[:3], 64))
        return out.to(q.dtype)


class _FlaL2Norm(torch.autograd.Function):
    """fla's l2norm as the memory sees it: the bf16 output kept (the CPU path keeps float32)."""

    @staticmethod
    def forward(ctx, x):
        from swift_megatron.model.gdn import l2norm_torch

        y = l2norm_torch(x)
        ctx.save_for_backward(y)
        return y


def test_a_gated_deltanet_layer_keeps_what_the_estimate_counts(model, monkeypatch):
    """What a Gated DeltaNet layer's mixer keeps per token (its modules but in_proj, whose input
    is the norm output counted among the layer's hidden-wide tensors), with fla's kernels' saved
    tensors standing in for the CPU paths, against model/memory.py's `_mixer_values` (Qwen3.5-9B
    widths: 103 KB counted, 102 KB estimated; here narrower heads)."""
    from megatron.core.ssm import gated_delta_net

    from swift_megatron.model.build import build_model
    from swift_megatron.model.memory import _mixer_values

    hf = dict(model_type="qwen3_5", vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
              num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-6, rope_theta=1e7,
              partial_rotary_factor=0.25, max_position_embeddings=256,
              tie_word_embeddings=False)
    gdn, _, _ = build_model(hf, torch.bfloat16, torch.device("cpu"))   # routes the layer's kernels
    monkeypatch.setattr(gated_delta_net, "chunk_gated_delta_rule",
                        lambda q, k, v, g=None, beta=None, **_: (_FlaSaves.apply(q, k, v, g, beta),
                                                                 None))
    monkeypatch.setattr(gated_delta_net, "l2norm", _FlaL2Norm.apply)
    tokens = sum(LENGTHS)
    hidden = torch.randn(tokens, 1, 512, dtype=torch.bfloat16, requires_grad=True)
    counter = SavedTensors(gdn)
    counter.run(lambda: gdn.decoder.layers[0](hidden, attention_mask=None,
                                               packed_seq_params=_packed()))
    mixer = sum(nbytes for nbytes, where, *_ in counter.saved.values()
                if ".self_attention" in where and not where.endswith("in_proj")) / tokens
    print(f"\nGated DeltaNet mixer: {mixer:.0f} B/token: {counter.breakdown(tokens)}")
    assert mixer == pytest.approx(2 * _mixer_values(hf, 2 * 64), rel=0.05)
