"""RoPE for packed (THD) micro-batches: one batched op per query and per key.

megatron-core 0.16.1 rotates packed sequences (`apply_rotary_pos_emb` with cu_seqlens, i.e.
`_apply_rotary_pos_emb_thd`) by splitting the tokens per sequence after `cu_seqlens.tolist()`
(a device-to-host sync), concatenating each sequence's slice of the frequency table and taking
cos / sin of it again, for the query and the key of every layer. Here each token's position in
its own sequence comes from cu_seqlens on the device, the frequencies are gathered per token,
and their cos / sin (cast to the activations' dtype, the rotate-half sign folded into the sine)
are computed once per micro-batch and model, cached on the micro-batch's PackedSeqParams; each
layer then rotates its query and its key with four elementwise ops apiece (five with partial
rotary, `rotary_percent` < 1). Same arithmetic as megatron's, so the eager results are
bit-identical (tests/unit/test_packed_rope.py). `RotateFn` is the autograd node: its backward
(`rotate_grad`) computes in float32 and rounds once. On CUDA both run compiled
(model/compiled.py, `SWIFT_MEGATRON_COMPILE_LAYERS`): one kernel per query / key and pass.

`PackedRopeSelfAttention` (our layer spec's self-attention, model/spec.py) takes this path and
leaves megatron's own in place where it does not apply: context parallelism (megatron offsets
each CP rank's positions to its zigzag chunks), interleaved rotary, fused RoPE, multi-latent
attention, inference contexts, padded cu_seqlens, offloaded QKV activations, and padded (BSHD)
batches. Frequencies as long as the packed row (M-RoPE's per-token angles) are used as they
are, as megatron does for that layout.
"""
from typing import Optional, Tuple

import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import \
    _yarn_get_concentration_factor_from_config
from megatron.core.transformer.attention import SelfAttention
from torch.utils.weak import WeakIdKeyDictionary

from swift_megatron.model.activations import wide
from swift_megatron.model.compiled import LAYERS_ENV, Compiled

# PackedSeqParams of a micro-batch -> [(frequency table, dtype, mscale, cos, signed sin)]
_TABLES = WeakIdKeyDictionary()


def positions_in_sequences(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] the index of each packed token within its own sequence (cu_seqlens [N + 1])."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(torch.int64), tokens, right=True)
    return tokens - cu_seqlens.to(torch.int64)[sequence]


def rotary_tables(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int,
                  dtype: torch.dtype, mscale: float = 1.0
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [total, 1, 1, rot] of every packed token from megatron's frequency
    table `freqs` ([max_seqlen, 1, 1, rot] by position in the sequence, or [total, 1, 1, rot]
    per token). The sine's first half is negated: `rotate` multiplies it with the swapped halves
    instead of megatron's rotate_half (-x2, x1), which gives the same products exactly."""
    if freqs.size(0) != total:
        freqs = freqs[positions_in_sequences(cu_seqlens, total)]
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE (non-interleaved) of packed t [total, 1, heads, dim] with `rotary_tables`' cos /
    signed sin: the first `rot` features rotate, the rest pass through."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    partial = rot != t.shape[-1]
    x = t[..., :rot] if partial else t
    out = x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
    return torch.cat((out, t[..., rot:]), dim=-1) if partial else out


def rotate_grad(grad: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """d/dt of `rotate` (linear in t): grad * cos plus the halves of grad * signed_sin swapped
    back, in float32, rounded once; the pass-through features' gradient as it comes."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    g = wide(grad[..., :rot])
    scaled = g * wide(signed_sin)
    dx = (g * wide(cos) + torch.cat((scaled[..., half:], scaled[..., :half]), dim=-1))
    dx = dx.to(grad.dtype)
    return torch.cat((dx, grad[..., rot:]), dim=-1) if rot != grad.shape[-1] else dx


MATH = Compiled("packed RoPE kernels", LAYERS_ENV, dict(rotate=3, rotate_grad=3), rotate=rotate,
                rotate_grad=rotate_grad)


class RotateFn(torch.autograd.Function):
    """MATH's rotate of t [total, 1, heads, dim], keeping the tables alone (shared by every
    layer of the micro-batch)."""

    @staticmethod
    def forward(ctx, t, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        return MATH.run("rotate", t.device, t, cos, signed_sin)

    @staticmethod
    def backward(ctx, grad):
        cos, signed_sin = ctx.saved_tensors
        return MATH.run("rotate_grad", grad.device, grad, cos, signed_sin), None, None


def cached_rotary_tables(params, freqs: torch.Tensor, total: int, dtype: torch.dtype,
                         mscale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """`rotary_tables` of a micro-batch (its PackedSeqParams), computed by its first layer and
    reused by the others (and by a recomputed forward); dropped with the PackedSeqParams."""
    entries = _TABLES.setdefault(params, [])
    for table, kind, scale, cos, sin in entries:
        if table is freqs and kind == dtype and scale == mscale:
            return cos, sin
    cos, sin = rotary_tables(params.cu_seqlens_q, freqs, total, dtype, mscale)
    entries.append((freqs, dtype, mscale, cos, sin))
    return cos, sin


class PackedRopeSelfAttention(SelfAttention):
    """megatron's SelfAttention whose RoPE on packed micro-batches is `rotate` with per-token
    tables (module docstring): the forward runs without rotary_pos_emb and the query / key are
    rotated right after the QKV projection (and the q/k norms), where megatron's forward would
    next rotate them (only inference-time adjustments lie in between, and none run here)."""

    _rope: Optional[tuple] = None  # (PackedSeqParams, frequency table, mscale) of this forward

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        freqs = self._batched_freqs(kwargs)
        if freqs is None:
            return super().forward(hidden_states, attention_mask, **kwargs)
        self._rope = (kwargs["packed_seq_params"], freqs,
                      _yarn_get_concentration_factor_from_config(self.config))
        try:
            return super().forward(hidden_states, attention_mask,
                                   **dict(kwargs, rotary_pos_emb=None))
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        output = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope is None:
            return output
        params, freqs, mscale = self._rope
        query, key = output[:2]  # [t, 1, heads, dim]
        tables = cached_rotary_tables(params, freqs, query.shape[0], query.dtype, mscale)
        return (RotateFn.apply(query, *tables), RotateFn.apply(key, *tables)) + tuple(output[2:])

    def _batched_freqs(self, kwargs) -> Optional[torch.Tensor]:
        """The frequency table when this forward can take the batched path, else None."""
        params, freqs = kwargs.get("packed_seq_params"), kwargs.get("rotary_pos_emb")
        if isinstance(freqs, tuple):
            freqs = freqs[0] if freqs[0] is freqs[1] else None
        config = self.config
        if (freqs is None or params is None or params.qkv_format != "thd"
                or params.cu_seqlens_q is not params.cu_seqlens_kv
                or params.cu_seqlens_q_padded is not None
                or params.cu_seqlens_kv_padded is not None
                or kwargs.get("inference_context") is not None
                or kwargs.get("inference_params") is not None
                or config.context_parallel_size > 1 or config.rotary_interleaved
                or config.apply_rope_fusion or config.multi_latent_attention
                or config.flash_decode or self.offload_qkv_linear
                or (config.no_rope_freq and config.no_rope_freq[self.layer_number - 1])):
            return None
        return freqs
