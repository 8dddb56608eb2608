"""Work-arounds for megatron-core 0.16.1 running without Transformer Engine (our only setup:
TE is absent on CPU and on the GPU machine).

- moe_utils references `te_general_gemm` in the router's linear function but defines it only
  when TE imports; without TE the router crashes with NameError. Defining it as None selects
  megatron's own torch.mm path.
- RoPE on packed (THD) sequences, unfused: megatron builds each call's per-token frequencies
  with a Python loop over the sequences after `cu_seqlens.tolist()`, a device-to-host sync, for
  the query and the key of every layer (56 syncs per forward of a 28-layer model; measured: the
  packed GRPO step was launch-bound). `packed_rope` computes the same frequencies on the device
  in three ops (each token's position in its sequence from cu_seqlens with searchsorted) and
  applies them in one call; with context parallelism megatron's own function still runs.
"""
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.moe import moe_utils

_MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd


def positions_in_sequences(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] the index of each packed token within its own sequence (cu_seqlens [N + 1])."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(torch.int64), tokens, right=True)
    return tokens - cu_seqlens.to(torch.int64)[sequence]


def packed_rope(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
                mscale=1.0, cp_group=None):
    """megatron's `_apply_rotary_pos_emb_thd` (t [t, h, d], freqs [max_s or t, 1, 1, d]) without
    host syncs. As megatron: frequencies as long as the packed tensor map by absolute position,
    shorter ones by each token's position in its sequence."""
    if cp_group is None or cp_group.size() > 1:
        return _MEGATRON_THD(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                             multi_latent_attention=multi_latent_attention, mscale=mscale,
                             cp_group=cp_group)
    if freqs.size(0) != t.size(0):
        freqs = freqs[positions_in_sequences(cu_seqlens, t.size(0))]
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs, rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)


def apply() -> None:
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    rope_utils._apply_rotary_pos_emb_thd = packed_rope


apply()
