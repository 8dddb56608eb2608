"""Gated DeltaNet kernels for megatron-core's `GatedDeltaNet` (Qwen3.5's linear attention).

megatron-core 0.16.1 imports `l2norm` and `chunk_gated_delta_rule` from flash-linear-attention
(fla) and refuses to build the layer without it. fla is Triton-only: it imports on CPU but its
kernels fail there ("0 active drivers"). `install()` puts dispatchers in their place that choose
per call: fla on CUDA tensors when fla imports, else a torch path (megatron's own
`torch_chunk_gated_delta_rule`, the chunked rule copied from transformers, and the L2 norm below).

megatron-core 0.16.1's layer refuses packed (THD) micro-batches; `PackedGatedDeltaNet` runs
them one sequence at a time through it (each sequence's convolution and recurrence start from
zero, as in a padded batch), which needs each rank to hold whole sequences: not with sequence
parallelism (preflight refuses --padding_free there). Context parallelism is not supported.
"""
import functools

import torch
from megatron.core.ssm import gated_delta_net

L2_EPS = 1e-6  # fla's and transformers' l2norm epsilon


def l2norm_torch(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 and cast back (fla's l2norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _fla():
    """fla's (l2norm, chunk_gated_delta_rule), or None when fla does not import."""
    try:
        from fla.modules.l2norm import l2norm
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return l2norm, chunk_gated_delta_rule


def uses_fla(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and _fla() is not None


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return _fla()[0](x) if uses_fla(x) else l2norm_torch(x)


def chunk_gated_delta_rule(query, key, value, **kwargs):
    if uses_fla(query):
        return _fla()[1](query, key, value, **kwargs)
    return gated_delta_net.torch_chunk_gated_delta_rule(query, key, value, **kwargs)


class PackedGatedDeltaNet(gated_delta_net.GatedDeltaNet):
    """megatron-core's GatedDeltaNet that also takes packed micro-batches ([t, 1, h] with
    `packed_seq_params.cu_seqlens_q`), one sequence at a time; rows past the last sequence (the
    padding that rounds a packed row up) give zeros."""

    def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
        if packed_seq_params is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        if self.sp_size > 1:
            raise ValueError("packed sequences through Gated DeltaNet need whole sequences on "
                             "each rank: not with sequence parallelism")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        outputs, bias = [], None
        for start, end in zip(bounds[:-1], bounds[1:]):
            out, bias = super().forward(hidden_states[start:end], None, *args, **kwargs)
            outputs.append(out)
        if bounds[-1] < hidden_states.shape[0]:
            outputs.append(hidden_states.new_zeros(hidden_states.shape[0] - bounds[-1],
                                                   *outputs[0].shape[1:]))
        return torch.cat(outputs), bias


def install() -> None:
    """Route megatron-core's GatedDeltaNet through the dispatchers (idempotent)."""
    gated_delta_net.l2norm = l2norm
    gated_delta_net.chunk_gated_delta_rule = chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True
