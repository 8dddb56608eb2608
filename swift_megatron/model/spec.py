"""The transformer layer spec: megatron-core's parallel linears, attention and MoE modules, with
modules of our own where the local (non-Transformer-Engine) spec falls short:

- `RMSNorm`: supports sequence parallelism (mcore's torch-norm wrapper rejects it). Its weight is
  marked `sequence_parallel` so finalize_model_grads all-reduces it across TP.
- `SDPAttention`: causal attention through torch's scaled_dot_product_attention (flash / memory-
  efficient kernels on GPU) instead of the local spec's unfused softmax(QK^T) that materialises
  S x S scores. Padded batches are right-padded, so causal masking alone is exact for every real
  token. Packed (THD) micro-batches, whose sequences lie back to back, go through torch's
  flash-attention varlen kernel (`torch.nn.attention.varlen`) on CUDA with
  `--attention_backend flash|auto`, else through SDPA one sequence at a time (every device).
  With context parallelism (CP > 1) each rank holds two chunks of every sequence (megatron's
  zigzag layout, parallel/context.py): the keys and values are all-gathered over the CP group
  (their gradients reduce-scattered back) and each local query chunk attends to the keys up to
  its own end through SDPA with a lower-right causal mask (`causal_lower_right`, which keeps
  the flash / memory-efficient kernels on GPU).
- `PackedRopeSelfAttention` (model/rope.py): megatron's SelfAttention with RoPE on packed
  micro-batches in one batched op per query / key (megatron rotates them sequence by sequence).

Hybrid models (qwen3_5*) get one spec per layer (`hybrid_block_spec`): megatron-core's
`GatedDeltaNet` for linear-attention layers (model/gdn.py's subclass, which also takes packed
sequences, with its kernels; parallel linears and `HeadRMSNorm` as the gated output norm) and
`SelfAttention` with the output gate for full ones, with `ZeroCenteredRMSNorm` ("1 + w") for the
decoder and q/k norms. megatron-core's own hybrid spec (experimental_attention_variant)
requires Transformer Engine.

MoE layers (`num_experts`): megatron-core's MoELayer with the experts as grouped GEMMs
(model/grouped_experts.py; the TransformerConfig's `moe_grouped_gemm`, `--moe_grouped_gemm`) or
megatron's SequentialMLP; model/build.py gives their dispatchers the device-side token dispatch
of model/moe_dispatch.py.

Transformer Engine is not used: it cannot be installed against CPU torch and is absent from the
GPU machine, so a TE path could not be tested here.
"""
import dataclasses
import inspect
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                          copy_to_tensor_model_parallel_region)
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch.nn.attention.bias import causal_lower_right

from swift_megatron.model.activations import RMSNormFn, SwiGLUMLP, tokens_first
from swift_megatron.model.grouped_experts import GroupedExperts
from swift_megatron.model.rope import PackedRopeSelfAttention
from swift_megatron.parallel.context import CPShare


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face does, as one
    autograd node that keeps its input alone (model/activations.py `RMSNormFn`), compiled on
    CUDA. Subclasses pick the math (`_kind`, a function of activations.MATH) or the weight it
    gets (`_weight`)."""

    _kind = "rms_norm"

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tokens_first(RMSNormFn.apply, x, self._weight(self.weight), self.eps, self._kind)

    def _weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored centred on zero: rms(x) * (1 + w) in float32, cast back
    (Qwen3.5's `Qwen3_5RMSNorm`; the weight starts at 0)."""

    _kind = "zero_centered_rms_norm"

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps)
        torch.nn.init.zeros_(self.weight)


class HeadRMSNorm(RMSNorm):
    """RMSNorm of each attention head's features inside a tensor-parallel region (Gated DeltaNet's
    output norm): every TP rank normalises its own heads with the same replicated weight, so the
    weight's gradient is partial on each rank and is summed over TP in the backward (with or
    without sequence parallelism; finalize_model_grads must not sum it again)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps)
        setattr(self.weight, "sequence_parallel", False)

    def _weight(self, weight: torch.Tensor) -> torch.Tensor:
        return copy_to_tensor_model_parallel_region(weight)


class SDPAttention(MegatronModule):
    """Core attention: [s, b, heads, dim] q/k/v -> [s, b, heads * dim], causal, GQA-aware."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias")
        if self.config.context_parallel_size > 1:
            return self._context_parallel(query, key, value, attention_mask, packed_seq_params)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params).reshape(query.shape[0], -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        mask = None if attention_mask is None else ~attention_mask  # mcore: True = masked
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=q.shape[1] != k.shape[1])
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _packed(self, query, key, value, params):
        """[t, heads, dim] q/k/v of sequences back to back -> [t, heads, dim], causal within
        each sequence (cu_seqlens)."""
        dropout = self.dropout if self.training else 0.0
        if query.is_cuda and dropout == 0.0 and self.config.attention_backend in _VARLEN_BACKENDS:
            return varlen_causal(query, key, value, params.cu_seqlens_q, params.max_seqlen_q,
                                 self.scale)
        bounds = params.cu_seqlens_q.tolist()
        parts = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                 dropout_p=dropout,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            parts.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(parts)

    def _context_parallel(self, query, key, value, attention_mask, packed_seq_params):
        """Attention of this CP rank's query chunks against the whole sequences' keys (module
        docstring): padded [s, b, heads, dim] or packed [t, heads, dim] -> [s or t, b?, h*d]."""
        if attention_mask is not None:
            raise ValueError("SDPAttention with context parallelism supports causal masking only")
        packed = packed_seq_params is not None
        if packed:
            share = CPShare(packed_seq_params.cu_seqlens_q.tolist(), device=query.device)
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # [t, 1, h, d]
        else:
            share = CPShare([0, query.shape[0] * mpu.get_context_parallel_world_size()],
                            device=query.device)
        keys, values = (share.gather(t, 0, reduce_grads=True) for t in (key, value))
        dropout = self.dropout if self.training else 0.0
        parts, local_start = [], 0
        for (start, end), size in zip(zip(share.cu_seqlens[:-1], share.cu_seqlens[1:]),
                                      share.local_segments()):
            chunk = size // 2
            for k, index in enumerate((share.rank, 2 * share.cp - 1 - share.rank)):
                q = query[local_start + k * chunk:local_start + (k + 1) * chunk]
                visible = start + (index + 1) * chunk  # keys up to this chunk's end
                q, kk, vv = (t.permute(1, 2, 0, 3) for t in
                             (q, keys[start:visible], values[start:visible]))  # [b, h, s, d]
                out = F.scaled_dot_product_attention(
                    q, kk, vv, attn_mask=causal_lower_right(q.shape[2], kk.shape[2]),
                    scale=self.scale, dropout_p=dropout, enable_gqa=q.shape[1] != kk.shape[1])
                parts.append(out.permute(2, 0, 1, 3))  # [s, b, h, d]
            local_start += size
        out = torch.cat(parts)
        return out.reshape(out.shape[0], -1) if packed else out.reshape(*out.shape[:2], -1)


_VARLEN_BACKENDS = (AttnBackend.flash, AttnBackend.auto)


def varlen_causal(query, key, value, cu_seqlens, max_seqlen: int, scale: float):
    """Causal flash attention over packed sequences with torch's varlen kernel (CUDA). Its API
    changed between torch releases: causality is window_size (-1, 0) (torch 2.11+) or
    is_causal; without enable_gqa (torch 2.11) the K/V heads are repeated."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params and not math.isclose(scale, query.shape[-1] ** -0.5):
        raise ValueError("this torch's varlen_attn has no scale argument; use "
                         "--attention_backend unfused")
    cu = cu_seqlens.to(torch.int32)
    if query.shape[1] != key.shape[1] and "enable_gqa" not in params:  # repeat the K/V heads
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    kwargs = {"scale": scale} if "scale" in params else {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = query.shape[1] != key.shape[1]
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    return varlen_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _mlp(num_experts: Optional[int], grouped_experts: bool):
    """Routed experts: megatron's local MoE spec, with `grouped_experts` our grouped-GEMM
    experts (model/grouped_experts.py) instead of SequentialMLP; else our dense SwiGLUMLP (a
    class, not a ModuleSpec: TransformerLayer warns about ModuleSpecs of MLP classes it does not
    know, and so passes no process groups to them)."""
    if not num_experts:
        return SwiGLUMLP
    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=num_experts,
                                           moe_grouped_gemm=False)
    if not grouped_experts:
        return spec
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, experts=ModuleSpec(module=GroupedExperts)))


def _self_attention(qk_norm) -> ModuleSpec:
    return ModuleSpec(
        module=PackedRopeSelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, core_attention=SDPAttention,
            linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm))


def _gated_delta_net() -> ModuleSpec:
    from swift_megatron.model import gdn

    gdn.install()
    return ModuleSpec(module=gdn.PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=HeadRMSNorm, out_proj=RowParallelLinear))


def _layer(mixer: ModuleSpec, norm, num_experts: Optional[int],
           grouped_experts: bool) -> ModuleSpec:
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=mixer, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm, mlp=_mlp(num_experts, grouped_experts),
        mlp_bda=get_bias_dropout_add))


def layer_spec(qk_layernorm: bool, num_experts: Optional[int],
               grouped_experts: bool = False) -> ModuleSpec:
    """One decoder layer: pre-norm attention and MLP (or MoE) with residuals."""
    return _layer(_self_attention(RMSNorm if qk_layernorm else IdentityOp), RMSNorm, num_experts,
                  grouped_experts)


def hybrid_block_spec(layer_types: Sequence[str], num_experts: Optional[int],
                      grouped_experts: bool = False) -> TransformerBlockSubmodules:
    """The decoder block of one pipeline stage of a hybrid model (its slice of `layer_types`):
    Gated DeltaNet or gated full attention per layer, zero-centred norms."""
    full = _layer(_self_attention(ZeroCenteredRMSNorm), ZeroCenteredRMSNorm, num_experts,
                  grouped_experts)
    linear = _layer(_gated_delta_net(), ZeroCenteredRMSNorm, num_experts, grouped_experts)
    specs = [linear if kind == "linear_attention" else full for kind in layer_types]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=ZeroCenteredRMSNorm)


def block_spec(num_layers_in_stage: int, qk_layernorm: bool, num_experts: Optional[int],
               grouped_experts: bool = False) -> TransformerBlockSubmodules:
    """The decoder block of one pipeline stage (its layers plus the final norm)."""
    layer = layer_spec(qk_layernorm, num_experts, grouped_experts)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers_in_stage, layer_norm=RMSNorm)
