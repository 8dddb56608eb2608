"""One dataclass per command, composed of the argument groups it accepts.

`megatron rlhf` -> RlhfArguments, `megatron export` -> ExportCommandArguments,
`megatron rollout` -> RolloutCommandArguments. Cross-group checks that need no model live here;
the batch plan is built by `batch_inputs()` + arguments/batch_plan.py.
"""
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional

from swift_megatron.arguments.batch_plan import BatchInputs
from swift_megatron.arguments.data import DataArguments
from swift_megatron.arguments.export import ExportArguments
from swift_megatron.arguments.freeze import FreezeArguments
from swift_megatron.arguments.grpo import GRPOArguments
from swift_megatron.arguments.kernels import KernelArguments
from swift_megatron.arguments.lora import LoraArguments
from swift_megatron.arguments.model import ModelArguments
from swift_megatron.arguments.moe import MoeArguments
from swift_megatron.arguments.parallel import ParallelArguments
from swift_megatron.arguments.planning import PlanningArguments
from swift_megatron.arguments.rollout import (RolloutArguments, ServeArguments,
                                              ServeMultiTurnArguments, VllmEngineArguments)
from swift_megatron.arguments.training import BatchArguments, TrainingArguments, check_lr_bounds
from swift_megatron.errors import UserError


@dataclass
class RlhfArguments:
    """Flags of `megatron rlhf`."""

    model: ModelArguments
    data: DataArguments
    training: TrainingArguments
    batch: BatchArguments
    parallel: ParallelArguments
    grpo: GRPOArguments
    rollout: RolloutArguments
    vllm: VllmEngineArguments
    lora: LoraArguments
    freeze: FreezeArguments
    kernels: KernelArguments
    moe: MoeArguments
    planning: PlanningArguments
    # the flag names the user set (command line or config file); filled in by parse_command
    explicit: FrozenSet[str] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self):
        if (self.lora.adapters or self.training.mcore_adapter) and self.training.train_type == "full":
            self.training.train_type = "lora"  # as ms-swift: adapters to continue mean LoRA
            self.training.adjustments = ["--adapters/--mcore_adapter given: --train_type lora"]
        if self.training.lr is None:
            self.training.lr = 1e-4 if self.training.uses_lora else 1e-5
        check_lr_bounds(self.training)
        self._check_optimizer_flags()
        self._check_virtual_pipeline()
        if not self.planning.auto_parallel:   # --auto_parallel chooses the pipeline size
            self.parallel.check_split_has_pipeline()
        self._check_overlap_grad_reduce()
        t = self.training
        if self.model.model is None and not (t.mcore_model or t.mcore_adapter or t.load):
            raise UserError("--model is required (a local HF directory or a hub id), unless "
                            "--mcore_model, --mcore_adapter or --load gives a checkpoint that "
                            "holds or names it")
        if not self.data.dataset:
            raise UserError("--dataset is required (a local file, HF datasets name or ModelScope id)")
        g = self.grpo
        if g.use_gym_env and g.multi_turn_scheduler is None and self.rollout.vllm_mode != "server":
            raise UserError("--use_gym_env applies to multi-turn rollouts: pass "
                            "--multi_turn_scheduler (e.g. gym_scheduler with --gym_env), or run "
                            "the scheduler in the rollout server (--vllm_mode server)")
        self._check_async_generate()
        self._check_tail_logprobs()
        if self.moe.router_replay_mode == "R3" and g.multi_turn_scheduler is not None:
            raise UserError("--router_replay_mode R3 replays the routes of one generation per "
                            "completion; a multi-turn conversation's turns are generated "
                            "apart (not supported): drop --multi_turn_scheduler or use R2")
        self._check_token_dispatcher()
        self._check_moe_act()
        self._check_vision_lrs()
        self._check_lora_llm()
        self._check_freeze_ratio()
        if self.grpo.offload_ref_model and not self.grpo.has_frozen_reference(
                t.train_type == "lora"):
            raise UserError("--offload_ref_model true: there is no reference model to offload "
                            "(--beta 0, or --train_type lora, whose reference is the policy with "
                            "its adapters disabled, without --ref_model): drop the flag")

    def _check_vision_lrs(self) -> None:
        """--vit_lr / --aligner_lr set the learning rate of a vision part that trains (full
        training with --freeze_vit/--freeze_aligner false, or --train_type lora_llm); on a
        frozen part they would do nothing (ms-swift ignores them silently)."""
        t, frozen = self.training, frozen_vision_parts(self.model, self.training)
        for name, part, flag in (("vit_lr", "vit", "--freeze_vit"),
                                 ("aligner_lr", "aligner", "--freeze_aligner")):
            what = "vision tower" if part == "vit" else "aligner"
            if getattr(t, name) is None or not frozen[part]:
                continue
            if t.train_type == "lora":
                raise UserError(f"--{name}: --train_type lora freezes the {what} (adapters go on "
                                "the language model only); --train_type lora_llm trains it "
                                "fully, or drop the flag")
            raise UserError(f"--{name} sets the learning rate of the {what}, which {flag} "
                            f"true (the default) freezes: pass {flag} false, or drop --{name}")

    def _check_freeze_ratio(self) -> None:
        """ms-swift's rule: a freeze ratio other than 0 or 1 would cut each pipeline stage's
        parameters at another point."""
        ratio = self.freeze.freeze_parameters_ratio
        if 0 < ratio < 1 and self.parallel.pipeline_model_parallel_size > 1:
            raise UserError(f"--freeze_parameters_ratio {ratio} is not supported with "
                            "--pipeline_model_parallel_size > 1 (as ms-swift): name what to freeze "
                            "with --freeze_parameters (e.g. decoder.layers.0. decoder.layers.1.) "
                            "or --freeze_parameters_regex")

    def _check_lora_llm(self) -> None:
        """--train_type lora_llm trains the vision tower in full beside the adapters: a LoRA
        adapter alone does not hold the run's weights, so the HF copies are merged models (as
        ms-swift, which requires --merge_lora true) and an adapter cannot continue it."""
        t = self.training
        if t.train_type != "lora_llm":
            return
        if self.lora.adapters or t.mcore_adapter:
            raise UserError("--train_type lora_llm cannot continue from --adapters/--mcore_adapter "
                            "(an adapter does not hold the trained vision tower): resume the run "
                            "with --load, or start from its merged model (--model "
                            "checkpoint-<step>-merged)")
        if t.save_safetensors and not t.merge_lora:
            raise UserError("--train_type lora_llm needs --merge_lora true (as ms-swift): its HF "
                            "checkpoints are merged models, since the adapter alone does not "
                            "hold the trained vision tower")

    def _check_token_dispatcher(self) -> None:
        """--moe_token_dispatcher_type allgather: megatron-core's allgather dispatcher gathers
        equal token counts from every rank (it refuses variable sequence lengths). Without EP
        both dispatchers move the same tokens (all of them over expert-TP, if any), and
        alltoall's code runs."""
        p = self.parallel
        if self.kernels.moe_token_dispatcher_type == "allgather" and \
                p.expert_model_parallel_size > 1:
            raise UserError(
                "--moe_token_dispatcher_type allgather with --expert_model_parallel_size "
                f"{p.expert_model_parallel_size}: megatron-core's allgather dispatcher needs "
                "micro-batches of one length on every rank, and swift-megatron's vary; use "
                "--moe_token_dispatcher_type alltoall (the default)")

    @property
    def lora_on_experts(self) -> bool:
        """Whether LoRA adapts MoE experts' projections (lora/layers.py then runs grouped experts
        as SequentialMLP)."""
        targets = set(self.lora.target_modules)
        return self.training.uses_lora and bool(
            targets & {"all-linear", "gate_proj", "up_proj", "down_proj"})

    def _check_moe_act(self) -> None:
        """--recompute_modules moe_act recomputes the SwiGLU of grouped experts
        (model/grouped_experts.py); SequentialMLP's experts, which --moe_grouped_gemm false and
        LoRA on the experts' projections run, have no such recomputation."""
        if "moe_act" not in self.parallel.selective_recompute:
            return
        if not self.kernels.moe_grouped_gemm:
            raise UserError("--recompute_modules moe_act recomputes grouped experts' activation, "
                            "and --moe_grouped_gemm false runs them one by one: drop one of the "
                            "two (--recompute_modules moe recomputes the whole MoE layer)")
        if self.lora_on_experts:
            raise UserError("--recompute_modules moe_act: LoRA on the experts' projections "
                            "(--target_modules) runs them one by one, without it; use "
                            "--recompute_modules moe (the whole MoE layer)")

    def _check_async_generate(self) -> None:
        """--async_generate overlaps generation with training: on the rollout servers, or on
        the colocated vLLM engine (`_check_colocate_async`); one engine call per request (a
        multi-turn scheduler's turns depend on each other and on collectives)."""
        g = self.grpo
        if not g.async_generate:
            return
        if self.rollout.use_vllm is False:
            raise UserError("--async_generate true needs vLLM (the embedded engine generates "
                            "in the trainer's own thread): drop --async_generate or --use_vllm "
                            "false")
        if g.multi_turn_scheduler is not None:
            raise UserError("--async_generate true does not support multi-turn rollouts (as "
                            "ms-swift): drop --async_generate or --multi_turn_scheduler")
        if self.rollout.vllm_mode == "colocate":
            self._check_colocate_async()

    def _check_colocate_async(self) -> None:
        """The colocated engine generates the next batch in a thread of the training process
        while the trainer trains: both stay on the GPU the whole time, the engine never sleeps,
        nothing is offloaded, and the engine's thread runs no collective and no RNG of the
        trainer's (ms-swift runs async generation on servers only)."""
        r, v = self.rollout, self.vllm
        asked = [(r.sleep_level > 0, f"--sleep_level {r.sleep_level}", "--sleep_level 0"),
                 (r.offload_model, "--offload_model true", "--offload_model false"),
                 (r.offload_optimizer, "--offload_optimizer true", "--offload_optimizer false"),
                 (v.vllm_tensor_parallel_size > 1,
                  f"--vllm_tensor_parallel_size {v.vllm_tensor_parallel_size}",
                  "--vllm_tensor_parallel_size 1 (the engine's collectives would run beside "
                  "the trainer's)"),
                 (not r.vllm_request_seeds, "--vllm_request_seeds false",
                  "--vllm_request_seeds true (one seed per call forks the process's RNG, which "
                  "the trainer draws from at the same time)")]
        for wrong, given, needed in asked:
            if wrong:
                raise UserError(f"--async_generate true in colocate mode keeps the engine awake "
                                f"and the training state on the GPU while the next batch "
                                f"generates beside training: {given} cannot apply; pass "
                                f"{needed}, or use --vllm_mode server")


    def tail_logprobs_problem(self) -> Optional[str]:
        """Why the flags leave --tail_logprobs nothing to run on (rlhf/grpo/tail.py), or None:
        its passes must run between engine steps in this process alone, with the models on
        the GPU."""
        p, g, r = self.parallel, self.grpo, self.rollout
        split = [f"--{name} {getattr(p, name)}" for name in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size") if getattr(p, name) > 1]
        if r.vllm_mode != "colocate" or r.use_vllm is False:
            return "it needs the colocated vLLM engine (--use_vllm true --vllm_mode colocate)"
        if g.async_generate:
            return "--async_generate generates the next batch while this one trains"
        if g.multi_turn_scheduler is not None:
            return "a multi-turn rollout's conversation is not done when a turn finishes"
        if split:
            return (f"{', '.join(split)} spread a model replica over several processes, which "
                    "would all have to join each pass between their engines' steps")
        if r.offload_model:
            return "--offload_model keeps the models in host memory while vLLM generates"
        if self.moe.router_replay_mode != "disabled":
            return (f"--router_replay_mode {self.moe.router_replay_mode}: the tail's passes "
                    "neither record nor replay routes")
        return None

    def _check_tail_logprobs(self) -> None:
        problem = self.tail_logprobs_problem()
        if self.rollout.tail_logprobs and problem:
            raise UserError(f"--tail_logprobs true cannot run here: {problem}; drop "
                            "--tail_logprobs (or pass false)")

    def _check_virtual_pipeline(self) -> None:
        """What the interleaved schedule (--virtual_pipeline_model_parallel_size) needs: PP > 1
        (megatron's rule), a fixed number of micro-batches, and one model chunk per stage for
        LoRA (its adapters and their files are per chunk: not implemented)."""
        p = self.parallel
        if not p.virtual_pipeline_model_parallel_size:
            return
        if p.pipeline_model_parallel_size == 1:
            raise UserError("--virtual_pipeline_model_parallel_size needs "
                            "--pipeline_model_parallel_size > 1 (it interleaves model chunks "
                            "over the pipeline stages)")
        if self.training.uses_lora:
            raise UserError(f"--train_type {self.training.train_type} with "
                            "--virtual_pipeline_model_parallel_size is not supported yet; drop "
                            "--virtual_pipeline_model_parallel_size")
        if self.batch.max_tokens_per_micro_batch is not None:
            raise UserError("--max_tokens_per_micro_batch varies the number of micro-batches, "
                            "which --virtual_pipeline_model_parallel_size needs to be a multiple "
                            "of --pipeline_model_parallel_size: use --micro_batch_size")

    def _check_overlap_grad_reduce(self) -> None:
        """megatron's overlapped reduction waits for every parameter it saw a gradient for in
        the first step; a trained vision part gets none in a batch without images."""
        frozen = frozen_vision_parts(self.model, self.training)
        if self.parallel.overlap_grad_reduce and not all(frozen.values()):
            raise UserError("--overlap_grad_reduce with a vision tower or aligner that trains is "
                            "not supported: a batch without images leaves their gradients out, "
                            "which the overlapped reduction waits for; drop one")

    def _check_optimizer_flags(self) -> None:
        """Combinations megatron-core 0.16.1's optimizer cannot run (training/optim.py checks
        the device and dtype rules once the model's are known)."""
        t, distributed = self.training, self.parallel.use_distributed_optimizer
        if t.optimizer_cpu_offload and not t.use_precision_aware_optimizer:
            raise UserError("--optimizer_cpu_offload needs --use_precision_aware_optimizer true, "
                            "as Megatron-LM requires: without it megatron-core 0.16.1 keeps the "
                            "float32 main parameters on the GPU and cannot reload the offloaded "
                            "state from a checkpoint")
        if (t.optimizer_cpu_offload or t.use_precision_aware_optimizer) and not distributed:
            raise UserError("--optimizer_cpu_offload and --use_precision_aware_optimizer need "
                            "--use_distributed_optimizer true")
        low = [f"--{n} {getattr(t, n)}" for n in ("exp_avg_dtype", "exp_avg_sq_dtype")
               if getattr(t, n) != "fp32"]
        if low and not t.use_precision_aware_optimizer:
            raise UserError(f"{' '.join(low)} needs --use_precision_aware_optimizer true (as "
                            "ms-swift and megatron-core)")
        if low and t.optimizer_cpu_offload:
            raise UserError(f"{' '.join(low)} does not work with --optimizer_cpu_offload true: "
                            "megatron-core's hybrid optimizer keeps the offloaded Adam states "
                            "in float32; drop one")


def frozen_vision_parts(model: ModelArguments, training: TrainingArguments) -> Dict[str, bool]:
    """Which parts of a vision-language model's vision side stay frozen: the --freeze_vit /
    --freeze_aligner flags with full training, both with --train_type lora (adapters on the
    language model only), neither with lora_llm (trained in full, whatever the flags, as
    ms-swift)."""
    if training.train_type == "lora":
        return {"vit": True, "aligner": True}
    if training.train_type == "lora_llm":
        return {"vit": False, "aligner": False}
    return {"vit": model.freeze_vit, "aligner": model.freeze_aligner}


@dataclass
class ExportCommandArguments:
    """Flags of `megatron export`. The forms of ms-swift's `megatron export` and ours:
    a base model (--model and/or --mcore_model, or the base an adapter checkpoint names), an
    optional adapter (--adapters or --mcore_adapter), and what to write (--to_hf / --to_mcore,
    or --merge_lora true alone for a merged HF checkpoint)."""

    model: ModelArguments
    parallel: ParallelArguments
    export: ExportArguments
    lora: LoraArguments
    explicit: FrozenSet[str] = field(default=frozenset(), init=False, repr=False)

    @property
    def adapter(self) -> Optional[str]:
        """The adapter path given (--adapters or --mcore_adapter), if any."""
        return self.lora.adapters[0] if self.lora.adapters else self.export.mcore_adapter

    def __post_init__(self):
        p = self.parallel
        p.check_split_has_pipeline()
        if p.context_parallel_size > 1 or p.virtual_pipeline_model_parallel_size:
            raise UserError("megatron export loads the model in a TP/PP/EP layout only: drop "
                            "--context_parallel_size and --virtual_pipeline_model_parallel_size "
                            "(a conversion needs neither; its output loads in any layout)")
        e = self.export
        if e.to_hf and e.to_mcore:
            raise UserError("choose one of --to_hf true and --to_mcore true")
        if self.lora.adapters and e.mcore_adapter:
            raise UserError("pass one of --adapters and --mcore_adapter")
        if e.merge_lora is None:
            e.merge_lora = e.to_hf  # ms-swift's default
        if not (self.model.model or e.mcore_model or self.adapter):
            raise UserError("pass the model: --model (an HF directory or hub id), --mcore_model "
                            "(a Megatron checkpoint), or an adapter checkpoint that names its "
                            "base (--adapters / --mcore_adapter)")
        if e.to_hf or e.to_mcore:
            self._check_conversion()
        else:
            self._check_without_conversion()

    def _check_conversion(self) -> None:
        e = self.export
        if e.to_hf and not (e.mcore_model or self.adapter):
            raise UserError("--to_hf true writes a Megatron checkpoint or an adapter as HF: pass "
                            "--mcore_model, or --adapters / --mcore_adapter")
        if e.output_dir is None:
            e.output_dir = self._default_output_dir()

    def _default_output_dir(self) -> str:
        """ms-swift's default: <checkpoint>-mcore|hf beside the adapter or Megatron checkpoint,
        else ./<model name>-mcore|hf."""
        import os

        suffix = "mcore" if self.export.to_mcore else "hf"
        checkpoint = self.adapter or self.export.mcore_model
        if checkpoint:
            return f"{os.path.normpath(checkpoint)}-{suffix}"
        return f"{os.path.basename(os.path.normpath(self.model.model))}-{suffix}"

    def _check_without_conversion(self) -> None:
        e = self.export
        if e.mcore_adapter:
            raise UserError("--mcore_adapter needs --to_hf true or --to_mcore true")
        if e.merge_lora and not (self.lora.adapters and self.model.model):
            raise UserError("--merge_lora true without --to_hf/--to_mcore merges --adapters "
                            "PEFT_DIR onto --model HF_DIR: pass both (or --to_hf true)")
        if not (e.merge_lora or e.test_convert_precision):
            raise UserError("nothing to do: pass --to_mcore true, --to_hf true, --merge_lora true "
                            "or --test_convert_precision true")
        if e.merge_lora and not e.output_dir:
            raise UserError("--output_dir is required for a conversion")


@dataclass
class RolloutCommandArguments:
    """Flags of `megatron rollout`."""

    model: ModelArguments
    vllm: VllmEngineArguments
    serve: ServeArguments
    multi_turn: ServeMultiTurnArguments
    explicit: FrozenSet[str] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self):
        if self.model.model is None:
            raise UserError("--model is required")


def batch_inputs(args: RlhfArguments, world_size: int, num_experts: Optional[int] = None,
                 colocate_vllm: bool = False) -> BatchInputs:
    """The batch-plan inputs of an rlhf command for a given world size."""
    p, g = args.parallel, args.grpo
    return BatchInputs(
        world_size=world_size, micro_batch_size=args.batch.micro_batch_size,
        global_batch_size=args.batch.global_batch_size, num_generations=g.num_generations,
        generation_batch_size=g.generation_batch_size, steps_per_generation=g.steps_per_generation,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size or 1,
        colocate_vllm=colocate_vllm,
        vllm_tensor_parallel_size=args.vllm.vllm_tensor_parallel_size, num_experts=num_experts,
        expert_model_parallel_size=p.expert_model_parallel_size)
