"""`megatron rlhf --auto_parallel true`: read the GPUs and the flags into a planning Setting,
choose (plan.py), print the plan and the `auto_parallel flags:` line, and return the command
line with those flags appended, parsed again, so the dry run or the run uses exactly what a user
pasting the line would get.
"""
import os
from types import SimpleNamespace
from typing import List, Mapping, Sequence, Tuple

from swift_megatron.arguments.batch_plan import generation_size
from swift_megatron.arguments.commands import RlhfArguments, batch_inputs
from swift_megatron.errors import UserError
from swift_megatron.model.memory import GIB
from swift_megatron.model.text_config import text_config
from swift_megatron.model.layout import num_experts
from swift_megatron.planning.candidates import Layout, Space, divisors
from swift_megatron.planning.cost import Work
from swift_megatron.planning.plan import (MARGIN, TIME_PARTS, PART_NAMES, Plan, Scored, Setting,
                                          choose)


def device_bytes(args: RlhfArguments) -> int:
    """--gpu_memory_gib, else the visible GPU's memory; UserError without either."""
    if args.planning.gpu_memory_gib:
        return int(args.planning.gpu_memory_gib * GIB)
    if args.model.device != "cpu":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    raise UserError("--auto_parallel needs the memory of one GPU and none is visible here: "
                    "pass --gpu_memory_gib (e.g. 80 for an H100, 141 for an H200)")


def gpus_per_node(env: Mapping[str, str] = os.environ) -> int:
    """Processes per node: the launcher's LOCAL_WORLD_SIZE, else NPROC_PER_NODE's."""
    from swift_megatron.launch import nproc_per_node, under_launcher

    if under_launcher(env) and env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"])
    return nproc_per_node(env)


def _logprob_passes(args: RlhfArguments, steps: int) -> float:
    """Forward passes over a rollout batch before training: the reference (beta != 0), the
    teacher, and the old policy for the steps after the first (data/passes.py)."""
    g = args.grpo
    old = 1.0 if g.num_iterations > 1 or g.kl_in_reward else (steps - 1) / steps
    return (g.beta != 0) + bool(g.teacher_model) + old


def make_work(args: RlhfArguments, hf: Mapping, world: int, colocate: bool) -> Work:
    from swift_megatron.preflight import image_patches, sequence_length

    inputs = batch_inputs(args, world)
    sequences = generation_size(inputs)
    steps = max(1, sequences // args.batch.global_batch_size)
    return Work(sequences=sequences, sequence_tokens=sequence_length(args),
                completion_tokens=args.grpo.max_completion_length, optimizer_steps=steps,
                logprob_passes=_logprob_passes(args, steps), world=world,
                gpus_per_node=min(gpus_per_node(), world), colocate=colocate,
                lora=args.training.uses_lora, micro_batch_size=args.batch.micro_batch_size,
                image_patches=image_patches(args, hf),
                pipeline_split=(args.parallel.decoder_first_pipeline_num_layers,
                                args.parallel.decoder_last_pipeline_num_layers))


def _choices(args: RlhfArguments, given, options: Tuple, value) -> Tuple:
    """(value,) when the user set one of the flags `given`, else `options`."""
    names = (given,) if isinstance(given, str) else given
    return (value,) if any(n in args.explicit for n in names) else options


_FIXED = (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
          ("cp", "context_parallel_size"), ("ep", "expert_model_parallel_size"))


def make_space(args: RlhfArguments, hf: Mapping, work: Work, frozen_reference: bool,
               dtype: str) -> Space:
    p, t, world = args.parallel, args.training, work.world
    experts = num_experts(hf)
    cpu_options = (False, True) if p.use_distributed_optimizer and dtype != "float32" else \
        (t.optimizer_cpu_offload,)     # megatron's hybrid optimizer: bf16/fp16, sharded
    budgets = None
    if args.grpo.loss_type == "real" or p.virtual_pipeline_model_parallel_size:
        budgets = (None,)      # whole groups / a fixed micro-batch count: --micro_batch_size
    if "max_tokens_per_micro_batch" in args.explicit:
        budgets = (args.batch.max_tokens_per_micro_batch,)
    return Space(
        tp=_choices(args, "tensor_model_parallel_size", divisors(world),
                    p.tensor_model_parallel_size),
        pp=_choices(args, "pipeline_model_parallel_size", divisors(world),
                    p.pipeline_model_parallel_size),
        cp=_choices(args, "context_parallel_size", divisors(world), p.context_parallel_size),
        ep=_choices(args, "expert_model_parallel_size", divisors(experts) if experts else (1,),
                    p.expert_model_parallel_size),
        sequence_parallel=_choices(args, "sequence_parallel", (True, False), p.sequence_parallel),
        full_recompute=_choices(args, ("recompute_granularity", "recompute_method",
                                       "recompute_num_layers"), (False, True),
                                p.recompute_granularity == "full"),
        offload_ref_model=_choices(args, "offload_ref_model", (False, True),
                                   args.grpo.offload_ref_model) if frozen_reference else (False,),
        offload_optimizer=_choices(args, "offload_optimizer", (False, True),
                                   args.rollout.offload_optimizer) if work.colocate else (False,),
        optimizer_cpu_offload=_choices(args, "optimizer_cpu_offload", cpu_options,
                                       t.optimizer_cpu_offload),
        budgets=budgets, gpus_per_node=work.gpus_per_node, sequence_tokens=work.sequence_tokens,
        fixed=frozenset(name for name, flag in _FIXED if flag in args.explicit))


def make_rules(args: RlhfArguments, hf: Mapping) -> SimpleNamespace:
    """The preflight's family rules as one check of (tp, cp, sp), ETP and VPP as given."""
    from swift_megatron.preflight import check_hybrid_support, check_moe_sequence_parallel

    family = args.model.model_type or text_config(hf)["model_type"]
    experts = num_experts(hf)

    def family_checks(tp: int, cp: int, sp: bool) -> None:
        parallel = SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                   sequence_parallel=sp)
        check_hybrid_support(SimpleNamespace(kernels=args.kernels, parallel=parallel), family)
        check_moe_sequence_parallel(experts, tp, sp)

    p = args.parallel
    etp = p.expert_tensor_parallel_size if "expert_tensor_parallel_size" in args.explicit else None
    return SimpleNamespace(etp=etp, vpp=p.virtual_pipeline_model_parallel_size or 1,
                           split=p.uneven_pipeline, family_checks=family_checks)


def make_setting(args: RlhfArguments, hf: Mapping, world: int, memory: int) -> Setting:
    from swift_megatron.preflight import read_local_hf_config, run_shape, uses_vllm

    colocate = uses_vllm(args) and args.rollout.vllm_mode == "colocate"
    base = run_shape(args, SimpleNamespace(dp_size=1,
                                           micro_batch_size=args.batch.micro_batch_size), hf)
    work = make_work(args, hf, world, colocate)
    frozen = base.reference_copy or base.reference_offloaded
    g = args.grpo
    teacher = read_local_hf_config(g.teacher_model) if g.teacher_model and \
        not g.offload_teacher_model else None
    return Setting(hf=hf, inputs=batch_inputs(args, world, num_experts(hf), colocate),
                   base=base, work=work, space=make_space(args, hf, work, frozen, base.dtype),
                   rules=make_rules(args, hf), device_bytes=memory, teacher=teacher)


# ---- printing ---------------------------------------------------------------------------------

def plan_flags(layout: Layout, setting: Setting) -> List[str]:
    """The flags of `layout` as a user would paste them (those the run reads)."""
    def word(value: bool) -> str:
        return "true" if value else "false"

    flags = ["--tensor_model_parallel_size", str(layout.tp), "--pipeline_model_parallel_size",
             str(layout.pp), "--context_parallel_size", str(layout.cp), "--sequence_parallel",
             word(layout.sequence_parallel)]
    if num_experts(setting.hf):
        flags += ["--expert_model_parallel_size", str(layout.ep)]
    base = setting.base
    granularity = "full" if layout.full_recompute else \
        "selective" if base.recompute_modules else "none"
    flags += ["--recompute_granularity", granularity]
    if base.reference_copy or base.reference_offloaded:      # a frozen reference exists
        flags += ["--offload_ref_model", word(layout.offload_ref_model)]
    if setting.work.colocate:
        flags += ["--offload_optimizer", word(layout.offload_optimizer)]
    if layout.optimizer_cpu_offload:
        flags += ["--optimizer_cpu_offload", "true", "--use_precision_aware_optimizer", "true"]
    if layout.max_tokens_per_micro_batch:
        flags += ["--max_tokens_per_micro_batch", str(layout.max_tokens_per_micro_batch)]
    return flags


def _s(seconds: float) -> str:
    """Seconds to 3 significant digits (a tiny model's steps take microseconds)."""
    return f"{seconds:.3g}"


def _times(scored: Scored) -> str:
    return ", ".join(f"{name} {_s(scored.times[name])}" for name in TIME_PARTS
                     if scored.times[name] or name in ("rollout", "logprobs", "train")) + \
        f", total {_s(scored.times['total'])}"


def why_lost(chosen: Scored, other: Scored) -> str:
    """The part of the step time that differs most, or the tie-break."""
    gap = other.times["total"] - chosen.times["total"]
    if gap <= 1e-9:
        return "as fast; the chosen layout is simpler (fewer model-parallel GPUs, no offload)"
    part = max(TIME_PARTS, key=lambda n: other.times[n] - chosen.times[n])
    return (f"{_s(gap)} s slower: {PART_NAMES[part]} {_s(other.times[part])} s against "
            f"{_s(chosen.times[part])} s")


def plan_lines(plan: Plan, setting: Setting) -> List[str]:
    work, chosen = setting.work, plan.chosen
    mode = f"colocate vLLM at {setting.base.vllm_fraction:g} of the GPU" if work.colocate else \
        "generation outside these GPUs (server mode or the embedded engine; not timed)"
    lines = [f"auto_parallel: {work.world} GPU(s), {work.gpus_per_node} per node, "
             f"{setting.device_bytes / GIB:.1f} GiB each; plans within {plan.usable_gib:.1f} GiB "
             f"({MARGIN:.0%} margin); {mode}",
             f"chosen: {chosen.layout.describe()}",
             "  memory per GPU (estimate, GiB): " + ", ".join(
                 f"{n} {chosen.memory[n]:.1f}" for n in ("weights", "gradients", "optimizer",
                                                         "reference", "activations", "vllm",
                                                         "train", "logprobs", "generate",
                                                         "peak")),
             f"  step time (estimate, s per rollout batch): {_times(chosen)}"]
    for other in plan.runners_up:
        lines.append(f"next: {other.layout.describe()}: {_s(other.times['total'])} s, peak "
                     f"{other.memory['peak']:.1f} GiB; {why_lost(chosen, other)}")
    if plan.rejected:
        lines.append(f"{plan.rejected} other candidates exceed {plan.usable_gib:.1f} GiB")
    lines.append("auto_parallel flags: " + " ".join(plan_flags(chosen.layout, setting)))
    return lines


# ---- the command ------------------------------------------------------------------------------

def model_config(args: RlhfArguments) -> dict:
    """config.json of --model (a directory, or only that file of a hub id: no weights)."""
    from swift_megatron.model.hub import hub_config
    from swift_megatron.preflight import model_files, read_local_hf_config

    files = model_files(args)
    if files is None:
        raise UserError("--auto_parallel needs the model's config.json: pass --model")
    return read_local_hf_config(files) or hub_config(files, args.model.use_hf,
                                                     args.model.model_revision)


def auto_parallel(args: RlhfArguments, argv: Sequence[str], world: int,
                  printing: bool = True) -> Tuple[List[str], RlhfArguments]:
    """Plan, print, and return (argv with the plan's flags, its arguments)."""
    from swift_megatron.arguments.parser import parse_command

    setting = make_setting(args, model_config(args), world, device_bytes(args))
    plan = choose(setting)
    if printing:
        print("\n".join(plan_lines(plan, setting)), flush=True)
    argv = [*argv, *plan_flags(plan.chosen.layout, setting)]
    return argv, parse_command(RlhfArguments, argv, prog="megatron rlhf")


def printing_rank(env: Mapping[str, str] = os.environ) -> bool:
    return env.get("RANK", "0") == "0"
