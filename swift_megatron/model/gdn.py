"""Gated DeltaNet kernels for megatron-core's `GatedDeltaNet` (Qwen3.5's linear attention).

megatron-core 0.16.1 imports `l2norm` and `chunk_gated_delta_rule` from flash-linear-attention
(fla) and refuses to build the layer without it. fla is Triton-only: it imports on CPU but its
kernels fail there ("0 active drivers"). `install()` puts dispatchers in their place that choose
per call: fla on CUDA tensors when fla imports, else a torch path (megatron's own
`torch_chunk_gated_delta_rule`, the chunked rule copied from transformers, and the L2 norm below).

Neither path supports packed sequences in megatron-core 0.16.1 (the layer raises), nor context
parallelism; the batch plan refuses both up front for hybrid models.
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


def install() -> None:
    """Route megatron-core's GatedDeltaNet through the dispatchers (idempotent)."""
    gated_delta_net.l2norm = l2norm
    gated_delta_net.chunk_gated_delta_rule = chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True
