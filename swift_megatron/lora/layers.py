"""TP-aware LoRA on megatron-core's parallel linears.

`apply_lora` turns each targeted ColumnParallelLinear / RowParallelLinear into its LoRA subclass
in place (the instance's class is swapped), so the base weights keep their mcore names
(`...linear_qkv.weight`: the bridge and distributed checkpoints see the same model) and the
adapters appear beside them as `...linear_qkv.lora_A.q_proj` / `...lora_B.q_proj`. A fused linear
holds one adapter per HF projection (linear_qkv: q_proj, k_proj, v_proj; linear_fc1: gate_proj,
up_proj), and their outputs are added at this rank's rows of the fused output.

y = W x + scale * B (A dropout(x)), with, per tensor-parallel group:

  column-parallel (x replicated, output rows split): A [r, in] replicated, B [rows, r] split like
    the weight's rows. z = A x is replicated; `copy_to_tensor_model_parallel_region(z)` sums dL/dz
    over TP in backward, so A's gradient and the input gradient are complete and identical on
    every rank (each rank's B only sees its own rows).
  row-parallel (x split, output all-reduced): A [r, in/tp] split like the weight's columns,
    B [out, r] replicated. z = all-reduce(A_local x_local) (`reduce_from_...`), so B's gradient is
    complete and identical on every rank and A_local's is exact.

Replicated adapter tensors therefore need no extra gradient reduction (finalize_model_grads has
nothing to do for them); split ones carry megatron's tensor-parallel attributes so grad-norm and
clipping count every shard.

With sequence parallelism the column-parallel input is split along the sequence: z = A x_local is
all-gathered along the sequence (backward: reduce-scatter, which sums dL/dz over TP); row-parallel
z is reduce-scattered along the sequence instead of all-reduced (backward: all-gather). The
replicated A (column) / B (row) then sees only this rank's tokens, so it is marked
`sequence_parallel` and finalize_model_grads sums its gradient over TP, as for layer norms.

Experts whose communication is explicit (EP or expert-TP > 1: the token dispatcher gathers /
reduce-scatters over expert-TP, the linears do not communicate) instead pass A (fc1) or B (fc2)
through `copy_to_...`: their gradients are summed over expert-TP in backward while input
gradients stay partial, as the dispatcher expects.

A linear whose (expert-)TP group has one rank communicates nothing: with its frozen base weight
the whole linear (the base product and the adapters) runs as one autograd node (lora/branch.py
`FrozenLinearWithAdapter`: the same math, fewer host operations; a LoRA step at one GPU waits on
the host), else its branch alone does (`AdapterBranch`); dropout then uses the default generator.

Initialisation follows peft (A kaiming-uniform, B zeros) and is layout independent: every rank
draws the FULL A of each projection from a generator seeded by (seed, global HF module name) and
keeps its slice, so TP=2 starts exactly where TP=1 does. Dropout on a replicated input uses the
default generator (identical on every TP rank); on a split input (row-parallel, or sequence
parallel) megatron's model-parallel one.

MoE layers whose experts are grouped GEMMs (model/grouped_experts.py) hold no parallel linear
per expert: when the targets include gate_proj, up_proj or down_proj, `apply_lora` first turns
them into megatron's SequentialMLP with the same weights (`to_sequential`), whose expert linears
get adapters as any other (the experts then run one by one, as with --moe_grouped_gemm false).

Bridge contract (bridge/ does not import lora/): adapter parameters carry `bridge_skip = True`
(neither loaded nor exported), and each adapted base weight carries `bridge_export`, a callable
giving the tensor to export for this rank's shard: W + scale * B A, computed out of place (the
base weight is never modified), or W itself while adapters are disabled.
"""
import contextlib
import hashlib
import math
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           get_cuda_rng_tracker,
                                           reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from swift_megatron.bridge import dims_of
from swift_megatron.bridge.mapping import Mapping
from swift_megatron.errors import UserError
from swift_megatron.lora.branch import AdapterBranch, AdapterLayout, FrozenLinearWithAdapter
from swift_megatron.lora.saved import base_weights, train_in_full, unload
from swift_megatron.model.grouped_experts import GroupedExperts, to_sequential
from swift_megatron.lora.targets import (LoraConfig, LoraTarget, find_targets, rows_on,
                                         split_index)


def _leaf(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_a(config: LoraConfig, hf_module: str, in_features: int) -> torch.Tensor:
    """The full initial A [r, in] of one projection: kaiming-uniform as peft, seeded by name."""
    a = torch.empty(config.r, in_features)
    return torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5),
                                          generator=_generator(config.seed, hf_module))


class _LoraMixin:
    """Adapter parameters, layout and the parts of the math shared by both parallel styles."""

    def _setup_lora(self, target: LoraTarget, config: LoraConfig) -> None:
        self.lora_target = target
        self.lora_r = config.r
        self.lora_scale = config.scale
        self.lora_dropout = config.lora_dropout
        self.lora_enabled = True
        self.lora_local_size = self.weight.shape[target.split_dim]
        index = split_index(target, self.lora_local_size, dims_of(self.config))
        self.lora_index = {name: index[name] for name in target.adapted}
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for hf in target.adapted:
            full_a = initial_a(config, hf, self.input_size)
            full_b = torch.zeros(self._full_out(hf), config.r)
            self.lora_A[_leaf(hf)] = self._adapter_param(self._local(hf, "A", full_a), "A")
            self.lora_B[_leaf(hf)] = self._adapter_param(self._local(hf, "B", full_b), "B")
        self.weight.bridge_export = self.merged_weight

    def _adapter_param(self, tensor: torch.Tensor, matrix: str) -> torch.nn.Parameter:
        param = torch.nn.Parameter(tensor.to(self.weight.device, self.weight.dtype))
        param.bridge_skip = True
        param.allreduce = getattr(self.weight, "allreduce", True)
        if matrix == self.SPLIT_MATRIX:
            set_tensor_model_parallel_attributes(param, True, self.lora_target.split_dim, 1)
        else:
            param.sequence_parallel = self._sequence_parallel()
        return param

    def _sequence_parallel(self) -> bool:
        """Whether this linear splits activations along the sequence (experts never do)."""
        return bool(self.sequence_parallel) and not self.explicit_expert_comm

    def _local(self, hf: str, matrix: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full HF-layout adapter tensor ("A" [r, in] or "B" [out, r])."""
        if matrix != self.SPLIT_MATRIX:
            return full
        rows = rows_on(self.lora_index[hf], self.lora_local_size, self.lora_target.shard.rank)
        return full.index_select(self.lora_target.split_dim, rows.to(full.device))

    def _full(self, hf: str, matrix: str, local: torch.Tensor) -> torch.Tensor:
        """The full HF-layout tensor from every rank's part (collective over the TP group)."""
        if matrix != self.SPLIT_MATRIX or self.lora_target.shard.size == 1:
            return local
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(self.lora_target.shard.size)]
        dist.all_gather(shards, local, group=self.tp_group)
        dim, index = self.lora_target.split_dim, self.lora_index[hf]
        shape = list(local.shape)
        shape[dim] = index.numel()
        full = local.new_empty(shape)
        for rank, shard in enumerate(shards):
            full.index_copy_(dim, rows_on(index, self.lora_local_size, rank).to(full.device), shard)
        return full

    # ---- adapters in HF layout (peft_io) -----------------------------------------------------
    def adapter_tensors(self, tensor_of=torch.Tensor.detach) -> Dict[str, torch.Tensor]:
        """{"<hf module>.lora_A.weight": full tensor, ...}: `tensor_of(param)` (the value, or
        e.g. its gradient) of every adapter tensor, gathered over TP. Collective."""
        out = {}
        for hf in self.lora_target.adapted:
            for matrix, params in (("A", self.lora_A), ("B", self.lora_B)):
                local = tensor_of(params[_leaf(hf)])
                out[f"{hf}.lora_{matrix}.weight"] = self._full(hf, matrix, local)
        return out

    def expected_shapes(self) -> Dict[str, tuple]:
        """The full HF shapes of the adapter tensors this module holds."""
        return {key: shape for hf in self.lora_target.adapted for key, shape in (
            (f"{hf}.lora_A.weight", (self.lora_r, self.input_size)),
            (f"{hf}.lora_B.weight", (self._full_out(hf), self.lora_r)))}

    @torch.no_grad()
    def load_adapter_tensors(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Copy this rank's parts of full HF-layout adapter tensors into the parameters."""
        for hf in self.lora_target.adapted:
            for matrix, params in (("A", self.lora_A), ("B", self.lora_B)):
                param = params[_leaf(hf)]
                full = tensors[f"{hf}.lora_{matrix}.weight"].to(param.device)
                param.copy_(self._local(hf, matrix, full))

    # ---- merged weight (the bridge's export hook) --------------------------------------------
    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + scale * B A (W alone while disabled); W is not modified."""
        weight = self.weight.detach()
        if not self.lora_enabled:
            return weight
        return self._add_delta(weight.float()).to(weight.dtype)

    def _communicates(self) -> bool:
        """Whether the adapter branch needs collectives ((expert-)tensor parallelism > 1); one
        that does not runs as a single autograd node (lora/branch.py)."""
        return self.lora_target.shard.size > 1

    def _branch(self, output: torch.Tensor, x: torch.Tensor, in_place: bool) -> torch.Tensor:
        """output + scale * B (A dropout(x)) for a linear that communicates nothing."""
        params = (*self.lora_A.values(), *self.lora_B.values())
        return AdapterBranch.apply(output, self._dropout(x, split_input=False), self._layout(),
                                   self.lora_scale, in_place, *params)

    def _fuses(self, weight: Optional[torch.Tensor]) -> bool:
        """Whether the whole linear runs as one node (`_fused`): adapters on, nothing to
        communicate, the module's own weight, frozen with its bias, and no megatron extras
        (deferred embedding weight gradients, CPU offloading of activations)."""
        return (self.lora_enabled and not self._communicates() and weight is None
                and not self.weight.requires_grad
                and (self.bias is None or not self.bias.requires_grad)
                and not self.config.defer_embedding_wgrad_compute
                and self.config._cpu_offloading_context is None)

    def _fused(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x W^T (+ bias) + scale * B (A dropout(x)) as one autograd node (lora/branch.py), the
        dropout drawn inside it."""
        params = (*self.lora_A.values(), *self.lora_B.values())
        dropout = self.lora_dropout if self.training else 0.0
        return FrozenLinearWithAdapter.apply(x, dropout, self.weight, bias, self._layout(),
                                             self.lora_scale, *params)

    def _dropout(self, x: torch.Tensor, split_input: bool) -> torch.Tensor:
        if not (self.lora_dropout and self.training):
            return x
        if not split_input:
            return F.dropout(x, self.lora_dropout)
        with get_cuda_rng_tracker().fork():  # each rank holds other elements: independent masks
            return F.dropout(x, self.lora_dropout)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base linear's sharded state dict, with the TP-split adapter tensors sharded along
        their split dim (the base class would call every extra tensor replicated)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        split = self._split_params()
        axes = {key: self.lora_target.split_dim for key in split}
        sharded.update(make_sharded_tensors_for_checkpoint(
            split, prefix, axes, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"]))
        return sharded


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """ColumnParallelLinear + one adapter per HF projection among its (fused) output rows."""

    SPLIT_MATRIX = "B"

    def _setup_lora(self, target: LoraTarget, config: LoraConfig) -> None:
        if self.gather_output:
            raise ValueError("LoRA on a ColumnParallelLinear with gather_output is not supported")
        super()._setup_lora(target, config)
        positions = [self.lora_index[hf][rows_on(self.lora_index[hf], self.lora_local_size,
                                                 target.shard.rank)] % self.lora_local_size
                     for hf in target.adapted]
        self.register_buffer("lora_positions", torch.cat(positions).to(self.weight.device),
                             persistent=False)
        blocks = torch.arange(len(positions)).repeat_interleave(
            torch.tensor([len(rows) for rows in positions]))
        self.register_buffer("lora_blocks", blocks.to(self.weight.device), persistent=False)

    def _full_out(self, hf: str) -> int:
        return self.lora_index[hf].numel()

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self._fuses(weight) and not runtime_gather_output:
            return (self._fused(input_, None if self.skip_bias_add else self.bias),
                    self.bias if self.skip_bias_add else None)
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.lora_enabled:
            return output, bias
        # the matmul's output is not saved for its backward: adding in place is safe and saves
        # a copy of the (large) fused output
        if not self._communicates():
            return self._branch(output, input_, in_place=True), bias
        return output.add_(self._lora(input_), alpha=self.lora_scale), bias

    def _layout(self) -> AdapterLayout:
        return AdapterLayout(self.lora_local_size, self.lora_positions, self.lora_blocks)

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        """The unscaled adapter output in the layout of this rank's fused output rows: one
        matmul with every projection's A stacked [k r, in], one with their B placed at their
        output rows [rows, k r] (zeros elsewhere)."""
        a = torch.cat(list(self.lora_A.values()))
        if self.explicit_expert_comm:
            a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
        z = F.linear(self._dropout(x, split_input=self._sequence_parallel()), a)
        if self._sequence_parallel():
            z = gather_from_sequence_parallel_region(z, group=self.tp_group)
        elif not self.explicit_expert_comm:
            z = copy_to_tensor_model_parallel_region(z, group=self.tp_group)
        return F.linear(z, self._placed_b())

    def _placed_b(self) -> torch.Tensor:
        """[this rank's fused output rows, k r]: projection i's B at its rows, columns i r.."""
        blocks = torch.block_diag(*self.lora_B.values())
        placed = blocks.new_zeros(self.lora_local_size, blocks.shape[1])
        return placed.index_copy(0, self.lora_positions, blocks)

    def _add_delta(self, weight: torch.Tensor) -> torch.Tensor:
        delta = torch.cat([b.float() @ a.float() for a, b in
                           zip(self.lora_A.values(), self.lora_B.values())])
        return weight.index_add(0, self.lora_positions, delta, alpha=self.lora_scale)

    def _split_params(self) -> Dict[str, torch.nn.Parameter]:
        return {f"lora_B.{key}": param for key, param in self.lora_B.items()}


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """RowParallelLinear + one adapter (its input columns split like the weight's)."""

    SPLIT_MATRIX = "A"

    def _setup_lora(self, target: LoraTarget, config: LoraConfig) -> None:
        if not self.input_is_parallel:
            raise ValueError("LoRA on a RowParallelLinear needs input_is_parallel")
        super()._setup_lora(target, config)

    def _full_out(self, hf: str) -> int:
        return self.output_size

    def forward(self, input_):
        if self._fuses(None):
            output = self._fused(input_, None)
            if self.skip_bias_add or self.bias is None:
                return output, self.bias if self.skip_bias_add else None
            return output + self.bias, None
        output, bias = super().forward(input_)
        if not self.lora_enabled:
            return output, bias
        if not self._communicates():
            # (at TP=1 megatron's reduce hands back its input as a view: no in-place add)
            return self._branch(output, input_, in_place=False), bias
        return output + self.lora_scale * self._lora(input_), bias

    def _layout(self) -> AdapterLayout:
        return AdapterLayout(self.output_size, None, None)

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        (a,), (b,) = self.lora_A.values(), self.lora_B.values()
        z = F.linear(self._dropout(x, split_input=True), a)
        if self.explicit_expert_comm:
            b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        elif self.sequence_parallel:
            z = reduce_scatter_to_sequence_parallel_region(z, group=self.tp_group)
        else:
            z = reduce_from_tensor_model_parallel_region(z, group=self.tp_group)
        return F.linear(z, b)

    def _add_delta(self, weight: torch.Tensor) -> torch.Tensor:
        (a,), (b,) = self.lora_A.values(), self.lora_B.values()
        return weight + self.lora_scale * (b.float() @ a.float())

    def _split_params(self) -> Dict[str, torch.nn.Parameter]:
        return {f"lora_A.{key}": param for key, param in self.lora_A.items()}


LORA_CLASSES = {ColumnParallelLinear: LoraColumnParallelLinear,
                RowParallelLinear: LoraRowParallelLinear}


# ---- model-level API ------------------------------------------------------------------------

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")   # what a routed expert holds

def lora_modules(model: torch.nn.Module) -> List[_LoraMixin]:
    """The adapted linears of a model (DDP-wrapped or not), in module order."""
    return [m for m in model.modules() if isinstance(m, _LoraMixin)]


def _check_model(model: torch.nn.Module) -> None:
    if not hasattr(model, "config") or hasattr(model, "module"):
        raise ValueError("apply_lora takes the GPTModel itself, before DDP wrapping")
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters")


def _unfuse_targeted_experts(model: torch.nn.Module, config: LoraConfig) -> None:
    """Grouped experts (model/grouped_experts.py) hold no linear to adapt: when the targets
    include the experts' projections, each MoE layer's grouped experts become megatron's
    SequentialMLP with the same weights first (one adapted MLP per expert)."""
    if not set(config.projections()) & set(EXPERT_PROJECTIONS):
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, GroupedExperts):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, to_sequential(module))


def apply_lora(model: torch.nn.Module, config: LoraConfig,
               mappings: Optional[List[Mapping]] = None) -> List[torch.nn.Module]:
    """Add adapters to the targeted linears of this stage's GPTModel (before DDP wrapping) and
    freeze every other parameter but those of `config.modules_to_save` (lora/saved.py).
    `mappings`: the bridge's family table (default: the shared decoder table). Returns the
    adapted modules."""
    _check_model(model)
    _unfuse_targeted_experts(model, config)
    targets = find_targets(model, config, mappings)
    if not targets:
        chosen = (f"target_regex {config.target_regex!r}" if config.target_regex is not None
                  else f"target_modules {list(config.target_modules)}")
        raise UserError(f"LoRA {chosen} match no linear layer of this model")
    for param in model.parameters():
        param.requires_grad_(False)
    train_in_full(model, config.modules_to_save)
    adapted = []
    for target in targets:
        module = model.get_submodule(target.module_name)
        module.__class__ = LORA_CLASSES[type(module)]
        module._setup_lora(target, config)
        adapted.append(module)
    return adapted


def adapter_parameters(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """{name: parameter} of every adapter tensor (with the weights of modules_to_save, the
    trainable parameters of a LoRA model)."""
    return {name: param for name, param in model.named_parameters()
            if getattr(param, "bridge_skip", False)}


@torch.no_grad()
def merge_and_unload(model: torch.nn.Module) -> None:
    """Fold every adapter into its base weight (W + scale * B A, in float32, rounded once to the
    weight's dtype), keep the modules trained in full as trained, and turn the LoRA linears back
    into megatron's: afterwards the model, its state dict and its sharded state dict are those of
    a plain GPTModel with merged weights."""
    unload(model)
    plain = {lora: base for base, lora in LORA_CLASSES.items()}
    for module in lora_modules(model):
        module.weight.copy_(module.merged_weight())
        del module.weight.bridge_export
        del module.lora_A, module.lora_B
        module._buffers.pop("lora_positions", None)
        module._buffers.pop("lora_blocks", None)
        module.__class__ = plain[type(module)]


@contextlib.contextmanager
def disabled(model: torch.nn.Module) -> Iterator[None]:
    """Adapters off inside the block, and the modules trained in full back to their base
    weights: forward (and the bridge's export) give the base model, e.g. for GRPO reference
    logprobs."""
    modules = lora_modules(model)
    previous = [m.lora_enabled for m in modules]
    for module in modules:
        module.lora_enabled = False
    try:
        with base_weights(model):
            yield
    finally:
        for module, enabled in zip(modules, previous):
            module.lora_enabled = enabled
