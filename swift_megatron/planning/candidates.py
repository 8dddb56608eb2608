"""The layouts --auto_parallel chooses from: every combination of TP, PP, CP, EP and sequence
parallelism that passes the batch rules (arguments/batch_plan.py), the model-shape rules
(model/layout.py) and the preflight's family rules (preflight.py), times the memory options
(full recomputation, reference and optimizer offload, the micro-batch token budget). A flag the
user set fixes its choice to the given value. Pure: no torch, no files.
"""
import dataclasses
from types import SimpleNamespace
from typing import FrozenSet, Iterator, List, Mapping, Optional, Tuple

from swift_megatron.arguments.batch_plan import BatchInputs, is_valid
from swift_megatron.errors import UserError
from swift_megatron.model.layout import check_expert_groups, check_layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: the values of the flags --auto_parallel sets."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    full_recompute: bool = False
    offload_ref_model: bool = False
    offload_optimizer: bool = False          # colocate: Adam state in host memory while generating
    optimizer_cpu_offload: bool = False      # the optimizer step on the CPU (megatron's hybrid)
    max_tokens_per_micro_batch: Optional[int] = None

    @property
    def structure(self) -> Tuple[int, int, int, int, bool]:
        return self.tp, self.pp, self.cp, self.ep, self.sequence_parallel

    def describe(self) -> str:
        """One line, e.g. `TP 2 PP 1 CP 1 EP 1, sequence parallel, ...`."""
        parts = [f"TP {self.tp} PP {self.pp} CP {self.cp} EP {self.ep}"]
        parts.append("sequence parallel" if self.sequence_parallel else "no sequence parallel")
        parts.append("full recompute" if self.full_recompute else "no full recompute")
        parts += [name for name, on in (("reference offloaded", self.offload_ref_model),
                                        ("optimizer offloaded while generating",
                                         self.offload_optimizer),
                                        ("optimizer on the CPU", self.optimizer_cpu_offload)) if on]
        budget = self.max_tokens_per_micro_batch
        parts.append(f"micro-batch budget {budget} tokens" if budget else "--micro_batch_size")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Space:
    """The values each choice may take; the rules that filter them."""

    tp: Tuple[int, ...]
    pp: Tuple[int, ...]
    cp: Tuple[int, ...]
    ep: Tuple[int, ...]
    sequence_parallel: Tuple[bool, ...]
    full_recompute: Tuple[bool, ...]
    offload_ref_model: Tuple[bool, ...]
    offload_optimizer: Tuple[bool, ...]
    optimizer_cpu_offload: Tuple[bool, ...]
    budgets: Optional[Tuple[Optional[int], ...]]   # None: powers of two x the sequence length
    gpus_per_node: int
    sequence_tokens: int                           # prompt + completion of one sequence
    fixed: FrozenSet[str] = frozenset()            # the choices the user's flags fixed


def divisors(n: int) -> Tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _rule_passes(check, *args, **kwargs) -> bool:
    try:
        check(*args, **kwargs)
    except UserError:
        return False
    return True


def expert_tensor_size(tp: int, ep: int, given: Optional[int]) -> int:
    """ETP as ParallelArguments resolves it: TP with EP 1, else the flag (default 1)."""
    return tp if ep == 1 else (given or 1)


def structure_ok(hf: Mapping, inputs: BatchInputs, structure, rules: SimpleNamespace) -> bool:
    """Whether (tp, pp, cp, ep, sp) passes every rule: the batch plan's, the model shape's,
    the family's (`rules.family_checks(tp, cp, sp)`), megatron's expert groups."""
    tp, pp, cp, ep, sp = structure
    etp = expert_tensor_size(tp, ep, rules.etp)
    batch = dataclasses.replace(inputs, tensor_model_parallel_size=tp,
                                pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                expert_model_parallel_size=ep)
    return (is_valid(batch)
            and _rule_passes(check_layout, hf, tp, pp, ep, etp, rules.vpp, **rules.split)
            and _rule_passes(check_expert_groups, inputs.world_size, pp, ep, etp)
            and _rule_passes(rules.family_checks, tp, cp, sp))


def structures(hf: Mapping, inputs: BatchInputs, space: Space,
               rules: SimpleNamespace) -> List[Tuple[int, int, int, int, bool]]:
    """The (tp, pp, cp, ep, sp) of `space` that pass every rule; TP inside one node."""
    found = []
    for tp in space.tp:
        for pp in space.pp:
            for cp in space.cp:
                for ep in space.ep:
                    for sp in space.sequence_parallel:
                        structure = (tp, pp, cp, ep, sp and tp > 1)
                        if tp <= space.gpus_per_node and structure not in found and \
                                structure_ok(hf, inputs, structure, rules):
                            found.append(structure)
    return found


def budgets(space: Space, sequences_per_rank_step: int) -> Tuple[Optional[int], ...]:
    """Token budgets: the user's, or 1, 2, 4, ... sequences' worth up to a step's share."""
    if space.budgets is not None:
        return space.budgets
    found, k = [], 1
    while k <= max(1, sequences_per_rank_step):
        found.append(k * space.sequence_tokens)
        k *= 2
    return tuple(found)


def layouts(space: Space, structure, sequences_per_rank_step: int) -> Iterator[Layout]:
    """Every memory option with one structure (an optimizer either offloaded while generating
    or run on the CPU, not both)."""
    tp, pp, cp, ep, sp = structure
    for full in space.full_recompute:
        for ref in space.offload_ref_model:
            for opt in space.offload_optimizer:
                for cpu in space.optimizer_cpu_offload:
                    if opt and cpu:
                        continue
                    for budget in budgets(space, sequences_per_rank_step):
                        yield Layout(tp, pp, cp, ep, sp, full, ref, opt, cpu, budget)
