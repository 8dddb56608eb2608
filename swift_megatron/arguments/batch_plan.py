"""The completion-level batch arithmetic of a GRPO run, and every rule it must satisfy.

Pure functions, no torch. `make_batch_plan` turns the flags and the world size into a BatchPlan
or raises BatchPlanError naming the flags involved and the nearest values that pass every rule.
The accepted set is ms-swift's Megatron GRPO (so its example scripts port unchanged):

  dp_size               = world_size / (TP x PP x CP)                         (a)
  global_batch_size     = micro_batch_size x dp_size x grad_accum_steps       (b)
  generation_batch_size = global_batch_size x steps_per_generation            (c)
  generation_batch_size % num_generations == 0                                (d)
  rollout prompts per DP group = generation_batch_size / num_generations / dp_size,
      an integer >= 1 and a multiple of micro_batch_size                      (e)
  generation_batch_size % world_size == 0 (equal generation share per rank)   (f)
  colocate: world_size % vllm_tensor_parallel_size == 0                       (g)
  num_experts % expert_model_parallel_size == 0 (once the model is read)     (h)
  interleaved pipeline (VPP > 1): grad_accum_steps % PP == 0 (megatron's
      schedule runs the micro-batches in groups of PP)                        (i)

Rule (e) is stated on global_batch_size in the seed docs; ms-swift's code and example scripts
apply it to the rollout batch, and so do we (docs/rlhf.md explains).
"""
import math
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

from swift_megatron.errors import UserError


class BatchPlanError(UserError):
    """A batch flag combination that cannot be scheduled; the message says what to use."""


@dataclass(frozen=True)
class BatchInputs:
    """The flags the plan depends on (None = not given)."""

    world_size: int
    micro_batch_size: int
    global_batch_size: int
    num_generations: int
    generation_batch_size: Optional[int] = None
    steps_per_generation: Optional[int] = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    colocate_vllm: bool = False
    vllm_tensor_parallel_size: int = 1
    num_experts: Optional[int] = None
    expert_model_parallel_size: int = 1


@dataclass(frozen=True)
class BatchPlan:
    """Everything the trainer needs to schedule one rollout batch and its optimizer steps."""

    world_size: int
    dp_size: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int          # micro-batches per optimizer step on one DP rank
    num_generations: int
    steps_per_generation: int
    generation_batch_size: int
    rollout_prompts: int           # prompts per rollout batch, all ranks
    train_prompts: float           # prompts per optimizer step (may be fractional)
    rollout_prompts_per_dp: int    # prompts per rollout batch on one DP group
    completions_per_dp: int        # completions per rollout batch on one DP group
    completions_per_rank: int      # completions each rank generates per rollout batch

    def table(self) -> str:
        rows = [
            ("world_size", self.world_size, "NPROC_PER_NODE x NNODES"),
            ("dp_size", self.dp_size, "world_size / (TP x PP x CP)"),
            ("micro_batch_size", self.micro_batch_size, "completions per forward/backward"),
            ("global_batch_size", self.global_batch_size, "completions per optimizer step"),
            ("grad_accum_steps", self.grad_accum_steps, "global / (micro x dp)"),
            ("num_generations", self.num_generations, "completions per prompt"),
            ("steps_per_generation", self.steps_per_generation, "optimizer steps per rollout"),
            ("generation_batch_size", self.generation_batch_size, "completions per rollout"),
            ("rollout_prompts", self.rollout_prompts, "generation / num_generations"),
            ("train_prompts", _fmt(self.train_prompts), "global / num_generations"),
            ("rollout_prompts_per_dp", self.rollout_prompts_per_dp, "rollout prompts / dp_size"),
            ("completions_per_dp", self.completions_per_dp, "generation / dp_size"),
            ("completions_per_rank", self.completions_per_rank, "generation / world_size"),
        ]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value:>8}  {note}" for name, value, note in rows)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def make_batch_plan(inputs: BatchInputs) -> BatchPlan:
    """Check every rule in order; the first violation raises BatchPlanError."""
    for rule in _RULES:
        if not rule.holds(inputs):
            raise BatchPlanError(rule.explain(inputs))
    return _plan(inputs)


def is_valid(inputs: BatchInputs) -> bool:
    """Whether every rule holds (each rule may assume the earlier ones hold)."""
    return all(rule.holds(inputs) for rule in _RULES)


def _model_parallel(i: BatchInputs) -> int:
    return i.tensor_model_parallel_size * i.pipeline_model_parallel_size * i.context_parallel_size


def _dp(i: BatchInputs) -> int:
    return i.world_size // _model_parallel(i)


def generation_size(i: BatchInputs) -> int:
    """generation_batch_size after defaulting (rule c must hold for it to mean anything)."""
    if i.generation_batch_size is not None:
        return i.generation_batch_size
    return i.global_batch_size * (i.steps_per_generation or 1)


def _plan(i: BatchInputs) -> BatchPlan:
    dp, gen = _dp(i), generation_size(i)
    return BatchPlan(
        world_size=i.world_size, dp_size=dp, micro_batch_size=i.micro_batch_size,
        global_batch_size=i.global_batch_size,
        grad_accum_steps=i.global_batch_size // (i.micro_batch_size * dp),
        num_generations=i.num_generations, steps_per_generation=gen // i.global_batch_size,
        generation_batch_size=gen, rollout_prompts=gen // i.num_generations,
        train_prompts=i.global_batch_size / i.num_generations,
        rollout_prompts_per_dp=gen // i.num_generations // dp, completions_per_dp=gen // dp,
        completions_per_rank=gen // i.world_size)


# ---- suggestions -------------------------------------------------------------------------

def _nearest(inputs: BatchInputs, flag: str, ok: Callable[[BatchInputs], bool]) -> List[int]:
    """Nearest values of `flag` (one below, one above) for which ok(inputs) holds."""
    value = getattr(inputs, flag) or 1
    limit = max(4 * value, 64) * max(inputs.world_size, inputs.num_generations, 1)
    below = next((v for v in range(value - 1, 0, -1) if ok(replace(inputs, **{flag: v}))), None)
    above = next((v for v in range(value + 1, limit + 1) if ok(replace(inputs, **{flag: v}))), None)
    return [v for v in (below, above) if v is not None]


def _use(inputs: BatchInputs, flag: str, rule: "Rule") -> str:
    """'use flag=X or Y': the nearest values that pass every rule (else at least this one)."""
    values = _nearest(inputs, flag, is_valid) or _nearest(inputs, flag, rule.holds)
    if not values:
        return f"no nearby {flag} passes every batch rule; change the other flags"
    return f"use {flag}={' or '.join(str(v) for v in values)}"


def _primary(i: BatchInputs) -> str:
    """The flag that sets the rollout batch: the one the user is most likely to adjust."""
    return "generation_batch_size" if i.generation_batch_size is not None else "global_batch_size"


def _or(values) -> str:
    return " or ".join(str(v) for v in values)


@dataclass(frozen=True)
class Rule:
    """A batch rule: `holds(inputs)` and, when it does not, `explain(inputs)`."""

    holds: Callable[[BatchInputs], bool]
    explain: Callable[[BatchInputs], str]


# ---- the rules, in the order they are checked --------------------------------------------

def _explain_a(i: BatchInputs) -> str:
    mp = _model_parallel(i)
    tps = [t for t in range(1, i.world_size + 1)
           if i.world_size % (t * i.pipeline_model_parallel_size * i.context_parallel_size) == 0]
    hint = (f"use tensor_model_parallel_size={_or(tps)}" if tps
            else "lower pipeline_model_parallel_size or context_parallel_size")
    return (f"world_size={i.world_size} (NPROC_PER_NODE x NNODES) is not divisible by "
            f"tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size "
            f"= {i.tensor_model_parallel_size} x {i.pipeline_model_parallel_size} x "
            f"{i.context_parallel_size} = {mp}: {hint}, or launch a multiple of {mp} processes")


RULE_A = Rule(lambda i: i.world_size % _model_parallel(i) == 0, _explain_a)

RULE_B = Rule(
    lambda i: i.global_batch_size % (i.micro_batch_size * _dp(i)) == 0,
    lambda i: (f"global_batch_size={i.global_batch_size} is not a multiple of micro_batch_size x "
               f"dp_size = {i.micro_batch_size} x {_dp(i)} = {i.micro_batch_size * _dp(i)}: "
               f"{_use(i, 'global_batch_size', RULE_B)}"))


def _holds_c(i: BatchInputs) -> bool:
    gen, spg, gbs = i.generation_batch_size, i.steps_per_generation, i.global_batch_size
    if gen is not None and spg is not None:
        return gen == gbs * spg
    return gen is None or gen % gbs == 0


def _explain_c(i: BatchInputs) -> str:
    gen, spg, gbs = i.generation_batch_size, i.steps_per_generation, i.global_batch_size
    if spg is not None:
        return (f"generation_batch_size={gen} and steps_per_generation={spg} disagree: "
                f"generation_batch_size must equal global_batch_size x steps_per_generation = "
                f"{gbs} x {spg} = {gbs * spg}; pass only one of them")
    return (f"generation_batch_size={gen} is not a multiple of global_batch_size={gbs}: "
            f"{_use(i, 'generation_batch_size', RULE_C)}")


RULE_C = Rule(_holds_c, _explain_c)

RULE_D = Rule(
    lambda i: generation_size(i) % i.num_generations == 0,
    lambda i: (f"generation_batch_size={generation_size(i)} is not a multiple of num_generations="
               f"{i.num_generations} (every prompt needs all its completions in one rollout "
               f"batch): {_use(i, _primary(i), RULE_D)}"))


def _holds_e(i: BatchInputs) -> bool:
    prompts, dp = generation_size(i) // i.num_generations, _dp(i)
    return prompts % dp == 0 and prompts // dp >= 1 and (prompts // dp) % i.micro_batch_size == 0


RULE_E = Rule(
    _holds_e,
    lambda i: (f"rollout prompts per DP group = generation_batch_size / num_generations / dp_size "
               f"= {generation_size(i)} / {i.num_generations} / {_dp(i)} must be a whole multiple "
               f"of micro_batch_size={i.micro_batch_size} (all completions of a prompt stay on "
               f"one DP rank): {_use(i, _primary(i), RULE_E)}"))

RULE_F = Rule(
    lambda i: generation_size(i) % i.world_size == 0,
    lambda i: (f"generation_batch_size={generation_size(i)} is not divisible by world_size="
               f"{i.world_size} (each rank generates an equal share): "
               f"{_use(i, _primary(i), RULE_F)}"))

RULE_G = Rule(
    lambda i: not i.colocate_vllm or i.world_size % i.vllm_tensor_parallel_size == 0,
    lambda i: (f"colocate mode: world_size={i.world_size} is not divisible by "
               f"vllm_tensor_parallel_size={i.vllm_tensor_parallel_size}: use "
               f"vllm_tensor_parallel_size="
               f"{_or(t for t in range(1, i.world_size + 1) if i.world_size % t == 0)}"))

RULE_H = Rule(
    lambda i: i.num_experts is None or i.num_experts % i.expert_model_parallel_size == 0,
    lambda i: (f"the model has num_experts={i.num_experts}, not divisible by "
               f"expert_model_parallel_size={i.expert_model_parallel_size}: use "
               f"expert_model_parallel_size="
               f"{_or(e for e in range(1, i.num_experts + 1) if i.num_experts % e == 0)}"))

def _accum(i: BatchInputs) -> int:
    return i.global_batch_size // (i.micro_batch_size * _dp(i))


RULE_I = Rule(
    lambda i: i.virtual_pipeline_model_parallel_size == 1
    or _accum(i) % i.pipeline_model_parallel_size == 0,
    lambda i: (f"virtual_pipeline_model_parallel_size={i.virtual_pipeline_model_parallel_size}: "
               f"the interleaved schedule runs micro-batches in groups of "
               f"pipeline_model_parallel_size={i.pipeline_model_parallel_size}, but "
               f"grad_accum_steps = global_batch_size / (micro_batch_size x dp_size) = "
               f"{_accum(i)}: {_use(i, 'global_batch_size', RULE_I)}"))

_RULES = (RULE_A, RULE_B, RULE_C, RULE_D, RULE_E, RULE_F, RULE_G, RULE_H, RULE_I)


# ---- rules of particular loss types --------------------------------------------------------

def _whole_groups(i: BatchInputs) -> bool:
    return i.micro_batch_size % i.num_generations == 0


def check_whole_groups(plan: BatchPlan, why: str) -> None:
    """A loss that compares the completions of a group inside one micro-batch (`why` says
    which) needs micro_batch_size to be a multiple of num_generations (the samples of a group
    are consecutive); BatchPlanError with the nearest micro_batch_size that passes every rule."""
    inputs = BatchInputs(world_size=plan.world_size, micro_batch_size=plan.micro_batch_size,
                         global_batch_size=plan.global_batch_size,
                         num_generations=plan.num_generations,
                         generation_batch_size=plan.generation_batch_size,
                         tensor_model_parallel_size=plan.world_size // plan.dp_size)
    if _whole_groups(inputs):
        return
    values = _nearest(inputs, "micro_batch_size", lambda i: _whole_groups(i) and is_valid(i))
    hint = (f"use micro_batch_size={_or(values)}" if values else
            f"raise global_batch_size so that micro_batch_size can be a multiple of "
            f"{plan.num_generations}")
    raise BatchPlanError(f"{why}: micro_batch_size={plan.micro_batch_size} must be a multiple of "
                         f"num_generations={plan.num_generations} (each micro-batch holds whole "
                         f"groups): {hint}")


def run_length(plan: BatchPlan, num_iterations: int, train_iters: Optional[int],
               num_train_epochs: Optional[float], num_prompts: int) -> Tuple[int, int]:
    """(optimizer steps, rollout batches) of a run: --train_iters steps, else
    --num_train_epochs passes over `num_prompts` training prompts (at least one rollout
    batch); each rollout batch makes steps_per_generation x num_iterations steps."""
    per_batch = plan.steps_per_generation * num_iterations
    if train_iters:
        steps = train_iters
    else:
        steps = max(math.ceil(num_train_epochs * num_prompts / plan.rollout_prompts), 1) * per_batch
    return steps, math.ceil(steps / per_batch)
