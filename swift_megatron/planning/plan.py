"""--auto_parallel: score every candidate layout (candidates.py) by the memory estimate
(model/memory.py) and the cost model (cost.py), keep those whose peak leaves MARGIN of the GPU
free, choose the fastest, and explain it: its memory and step time, the next two layouts and
why they lost, and the flags to paste. Nothing fits: a UserError naming what would.
"""
import dataclasses
from types import SimpleNamespace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from swift_megatron.arguments.batch_plan import BatchInputs
from swift_megatron.errors import UserError
from swift_megatron.model.memory import GIB, RunShape, estimate, rank_parameters
from swift_megatron.planning.candidates import Layout, Space, divisors, layouts, structures
from swift_megatron.planning.cost import Work, stage_layers, step_seconds

MARGIN = 0.10                    # of the GPU's memory, left free by the chosen plan
TIME_PARTS = ("rollout", "logprobs", "train", "tp", "cp", "ep", "pp", "bubble", "dp",
              "micro_batches", "offload", "sync")
PART_NAMES = dict(tp="TP communication", cp="CP exchange", ep="EP all-to-all",
                   pp="pipeline transfers", bubble="pipeline bubble", dp="DP gradient reduction",
                   micro_batches="per-micro-batch cost", offload="offload copies",
                   sync="weight sync", train="training compute", logprobs="logprob passes",
                   rollout="generation")


@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything the search reads: the model, the run's batch inputs at some layout, the
    memory shape of the user's flags (`base`), the work, the choices, the rules, the GPU."""

    hf: Mapping
    inputs: BatchInputs
    base: RunShape
    work: Work
    space: Space
    rules: SimpleNamespace
    device_bytes: int
    teacher: Optional[Mapping] = None


@dataclasses.dataclass(frozen=True)
class Scored:
    layout: Layout
    memory: Dict[str, float]     # the estimate, GiB
    times: Dict[str, float]      # seconds per rollout batch

    @property
    def key(self) -> Tuple:
        """Fastest first; ties to the simpler layout, then the larger budget."""
        l = self.layout
        return (round(self.times["total"], 9), l.tp * l.pp * l.cp * l.ep, l.pp, l.cp, l.tp,
                l.full_recompute, l.offload_ref_model, l.offload_optimizer,
                l.optimizer_cpu_offload, -(l.max_tokens_per_micro_batch or 0))


@dataclasses.dataclass(frozen=True)
class Plan:
    chosen: Scored
    runners_up: Tuple[Scored, ...]
    usable_gib: float
    rejected: int                # candidates over the memory limit


def run_shape(setting: Setting, layout: Layout) -> RunShape:
    """The memory estimate's shape of `layout`: the user's flags' shape with its values."""
    base, work = setting.base, setting.work
    dp = work.world // (layout.tp * layout.pp * layout.cp)
    per_micro = work.micro_batch_size
    if layout.max_tokens_per_micro_batch:
        per_micro = max(1, layout.max_tokens_per_micro_batch // work.sequence_tokens)
    frozen = base.reference_copy or base.reference_offloaded
    shape = dataclasses.replace(
        base, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, dp=dp,
        sequence_parallel=layout.sequence_parallel,
        micro_batch_tokens=layout.max_tokens_per_micro_batch or per_micro * work.sequence_tokens,
        reference_copy=frozen and not layout.offload_ref_model,
        reference_offloaded=frozen and layout.offload_ref_model,
        offload_optimizer=layout.offload_optimizer,
        optimizer_cpu_offload=layout.optimizer_cpu_offload,
        image_patches=per_micro * work.image_patches,
        teacher_parameters=rank_parameters(setting.teacher, RunShape(tp=layout.tp, pp=layout.pp))
        if setting.teacher else 0,
        stage_layers=stage_layers(setting.hf, layout, work) if any(work.pipeline_split) else None)
    if layout.full_recompute and not base.full_recompute:
        shape = dataclasses.replace(shape, full_recompute=True, recompute_method="uniform",
                                    recompute_num_layers=1, recompute_modules=())
    return shape


def score(setting: Setting, layout: Layout) -> Scored:
    shape = run_shape(setting, layout)
    memory = estimate(setting.hf, shape, setting.device_bytes)
    parts = dict(memory, weight_bytes=2 * rank_parameters(setting.hf, RunShape()),
                 reference_bytes=memory["weights"] * GIB if shape.reference_offloaded else 0)
    return Scored(layout, memory, step_seconds(setting.hf, layout, setting.work, parts))


def scored(setting: Setting) -> List[Scored]:
    """Every candidate of the setting, scored, fastest first."""
    found = []
    for structure in structures(setting.hf, setting.inputs, setting.space, setting.rules):
        tp, pp, cp = structure[:3]
        dp = setting.work.world // (tp * pp * cp)
        share = -(-setting.work.sequences // (setting.work.optimizer_steps * dp))
        found += [score(setting, layout) for layout in layouts(setting.space, structure, share)]
    return sorted(found, key=lambda s: s.key)


def usable_gib(setting: Setting) -> float:
    return setting.device_bytes * (1 - MARGIN) / GIB


def _runners_up(fitting: Sequence[Scored]) -> Tuple[Scored, ...]:
    """The best of the next two other structures (TP, PP, CP, EP, SP), else the next two."""
    chosen, picked = fitting[0], []
    for candidate in fitting[1:]:
        seen = [chosen.layout.structure] + [p.layout.structure for p in picked]
        if candidate.layout.structure not in seen:
            picked.append(candidate)
        if len(picked) == 2:
            return tuple(picked)
    rest = [c for c in fitting[1:] if c not in picked]
    return tuple(picked + rest[:2 - len(picked)])


def choose(setting: Setting) -> Plan:
    """The fastest candidate that fits; UserError saying what would fit when none does."""
    candidates = scored(setting)
    if not candidates:
        raise UserError("--auto_parallel: no layout passes the batch and model rules for "
                        f"{setting.work.world} GPUs: check the flags without --auto_parallel "
                        "(the dry run names the rule)")
    limit = usable_gib(setting)
    fitting = [c for c in candidates if c.memory["peak"] <= limit]
    if not fitting:
        raise UserError(no_fit_message(setting, candidates))
    return Plan(fitting[0], _runners_up(fitting), limit, len(candidates) - len(fitting))


# ---- nothing fits ----------------------------------------------------------------------------

def fits(setting: Setting) -> bool:
    limit = usable_gib(setting)
    return any(c.memory["peak"] <= limit for c in scored(setting))


def _more_gpus(setting: Setting) -> Optional[str]:
    """The smallest multiple of the GPU count (up to 8x, nodes of 8 or more) that fits."""
    for factor in (2, 4, 8):
        world = setting.work.world * factor
        per_node = min(world, max(setting.work.gpus_per_node, 8))
        grown = dataclasses.replace(
            setting, inputs=dataclasses.replace(setting.inputs, world_size=world),
            work=dataclasses.replace(setting.work, world=world, gpus_per_node=per_node),
            space=_grown_space(setting.space, world, per_node))
        if fits(grown):
            return f"{world} GPUs ({per_node} per node)"
    return None


def _grown_space(space: Space, world: int, per_node: int) -> Space:
    """The structural choices of `world` GPUs, keeping those the user fixed."""
    free = {name: divisors(world) for name in ("tp", "pp", "cp") if name not in space.fixed}
    return dataclasses.replace(space, gpus_per_node=per_node, **free)


def _shorter_completions(setting: Setting) -> Optional[str]:
    work, prompt = setting.work, setting.work.sequence_tokens - setting.work.completion_tokens
    length = work.completion_tokens // 2
    while length >= 64:
        shorter = dataclasses.replace(setting, work=dataclasses.replace(
            work, completion_tokens=length, sequence_tokens=prompt + length),
            space=dataclasses.replace(setting.space, sequence_tokens=prompt + length))
        if fits(shorter):
            return f"--max_completion_length {length} (and --max_length {prompt + length})"
        length //= 2
    return None


def _relaxations(setting: Setting) -> List[str]:
    """What would fit: more GPUs, the offloads the user's flags ruled out, LoRA, shorter
    completions, a smaller vLLM share."""
    found = [_more_gpus(setting)]
    space = setting.space
    offloads = dataclasses.replace(space, offload_ref_model=(False, True) if (
        setting.base.reference_copy or setting.base.reference_offloaded) else (False,),
        optimizer_cpu_offload=(False, True), full_recompute=(False, True))
    if offloads != space and fits(dataclasses.replace(setting, space=offloads)):
        found.append("offload: drop the flags that fix --offload_ref_model, "
                     "--optimizer_cpu_offload or --recompute_granularity")
    if not setting.base.lora:
        lora = dataclasses.replace(setting, base=dataclasses.replace(
            setting.base, lora=True, reference_copy=False, reference_offloaded=False),
            work=dataclasses.replace(setting.work, lora=True),
            space=dataclasses.replace(space, offload_ref_model=(False,)))
        if fits(lora):
            found.append("--train_type lora")
    found.append(_shorter_completions(setting))
    if setting.base.vllm_fraction >= 1 - MARGIN:
        found.append(f"--vllm_gpu_memory_utilization below {1 - MARGIN:g} (vLLM's share alone "
                     f"leaves nothing inside the margin)")
    elif setting.base.vllm_fraction > 0.1:
        lower = round(setting.base.vllm_fraction / 2, 2)
        if fits(dataclasses.replace(setting, base=dataclasses.replace(
                setting.base, vllm_fraction=lower))):
            found.append(f"--vllm_gpu_memory_utilization {lower}")
    return [f for f in found if f]


def no_fit_message(setting: Setting, candidates: Sequence[Scored]) -> str:
    best = min(candidates, key=lambda c: c.memory["peak"])
    relaxations = _relaxations(setting)
    would = "; ".join(relaxations) if relaxations else \
        "nothing tried here (more GPUs up to 8x, offload, LoRA, shorter completions)"
    return (f"--auto_parallel: no layout fits {setting.work.world} GPU(s) of "
            f"{setting.device_bytes / GIB:.1f} GiB with a {MARGIN:.0%} margin "
            f"({usable_gib(setting):.1f} GiB): the smallest estimated peak is "
            f"{best.memory['peak']:.1f} GiB ({best.layout.describe()}). What would fit: {would}")
