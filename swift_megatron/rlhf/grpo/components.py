"""Build everything a GRPO run needs from the flags, one small function per component:
parallel state, policy (Megatron DDP model + optimizer + schedule + bridge), reference and
teacher models, tokenizer and prompts, rollout engine, reward functions and reward models,
loggers. The trainer only runs the loop.
"""
import dataclasses
import json
import os
import tempfile
import time
from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import torch

from swift_megatron.arguments.batch_plan import BatchPlan, run_length
from swift_megatron.arguments.commands import RlhfArguments, frozen_vision_parts
from swift_megatron.bridge import Bridge
from swift_megatron.checkpoint.layout import hf_dir as layout_hf_dir
from swift_megatron.checkpoint.run_dir import RunLock, claim_run_dir, output_base, run_dirs
from swift_megatron.checkpoint.sources import (AdapterSource, WeightsSource, load_weights,
                                               peft_dir_of)
from swift_megatron.checkpoint.start import Start
from swift_megatron.compat.ms_swift import flat_args  # importing it: ms-swift plugin files load
from swift_megatron.data import Prompt, PromptSampler, prepare_prompts
from swift_megatron.data.images import ImageEncoder, resolve_max_pixels
from swift_megatron.errors import UserError
from swift_megatron.logging import CompletionsLogger, MetricsLogger, get_logger
from swift_megatron.logging.metrics import SinkSettings
from swift_megatron.lora import LoraConfig, apply_lora, load_adapter
from swift_megatron.model.build import build_chunks
from swift_megatron.model.config import DTYPES, load_hf_config
from swift_megatron.model.files import check_model_dir
from swift_megatron.model.hub import resolve_model_dir
from swift_megatron.model.layout import check_layout, num_experts
from swift_megatron.model.routing_replay import replay_settings
from swift_megatron.model.text_config import text_config
from swift_megatron.model.trainable import FreezeRules
from swift_megatron.model.vision import freeze, has_vision, takes_images, vision_part
from swift_megatron.parallel.state import ParallelState
from swift_megatron.preflight import (check_reward_sources, check_vision_flags,
                                      note_no_colocate_engine)
from swift_megatron.rewards import RewardConfig, load_plugins, resolve_reward_funcs
from swift_megatron.rewards.reward_model import reward_model_funcs
from swift_megatron.rlhf.grpo.collect import CollectSettings, RolloutCollector
from swift_megatron.rlhf.grpo.losses import FipoSettings
from swift_megatron.rlhf.grpo.objective import LossSettings
from swift_megatron.rlhf.grpo.reference_source import reference_source
from swift_megatron.rlhf.grpo.references import Reference
from swift_megatron.rlhf.grpo.teacher import Teacher, check_same_tokenizer
from swift_megatron.rollout.engine import SamplingConfig
from swift_megatron.rollout.factory import build_engine, engine_kind
from swift_megatron.training.freeze import apply_freeze
from swift_megatron.training.offload import grad_dropper, model_offloader, optimizer_offloader
from swift_megatron.training.optim import (OptimizerSettings, build_optimizer, build_scheduler,
                                           check_settings, overlap_sync_funcs, wrap_ddp)

logger = get_logger(__name__)


@dataclasses.dataclass
class Policy:
    chunks: List[torch.nn.Module]   # DDP-wrapped model chunks of this stage
    config: object                  # TransformerConfig
    bridge: Bridge
    optimizer: object
    scheduler: object
    model_dir: str                  # HF directory: config, tokenizer (and initial weights)
    hf_config: dict
    dtype: torch.dtype
    lora: Optional[LoraConfig] = None  # set for --train_type lora / lora_llm


def parallel_state(args: RlhfArguments) -> ParallelState:
    p = args.parallel
    return ParallelState.initialize(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size, device=args.model.device, seed=args.training.seed,
        vpp=p.virtual_pipeline_model_parallel_size, timeout_s=p.ddp_timeout,
        backend=p.ddp_backend, first_stage_layers=p.decoder_first_pipeline_num_layers,
        last_stage_layers=p.decoder_last_pipeline_num_layers)


def training_dtype(args: RlhfArguments, hf_config: dict, device: torch.device) -> torch.dtype:
    if args.model.torch_dtype:
        return DTYPES[args.model.torch_dtype]
    if device.type == "cpu":
        return torch.float32
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    return DTYPES.get(name, torch.bfloat16)


def _config_overrides(args: RlhfArguments, hf_config: dict) -> dict:
    """TransformerConfig settings from the flags, the same for the policy and the reference
    (and a teacher): the MoE flags (arguments/moe.py) for a model with experts."""
    from megatron.core.transformer.enums import AttnBackend

    p = args.parallel
    overrides = dict(attention_backend=AttnBackend[args.kernels.attention_backend],
                     moe_grouped_gemm=args.kernels.moe_grouped_gemm,
                     num_layers_in_first_pipeline_stage=p.decoder_first_pipeline_num_layers,
                     num_layers_in_last_pipeline_stage=p.decoder_last_pipeline_num_layers)
    if p.recompute_granularity:
        overrides.update(recompute_granularity=p.recompute_granularity,
                         recompute_method=p.recompute_method,
                         recompute_num_layers=p.recompute_num_layers,
                         recompute_modules=p.selective_recompute)
    if num_experts(hf_config):
        overrides.update(args.moe.config_overrides())
    return overrides


def _load_model(args, state: ParallelState, model_dir: str, hf_config: dict, dtype,
                weights: Optional[WeightsSource]):
    """The model chunks of this stage with the base weights: from `weights` (--mcore_model, a
    LoRA checkpoint's base) or else from the HF checkpoint at `model_dir` through the bridge."""
    chunks, config, shape = build_chunks(
        hf_config, dtype, state.device, sequence_parallel=args.parallel.sequence_parallel,
        model_type=args.model.model_type, random_init=False,
        **_config_overrides(args, hf_config), **replay_settings(args.moe.replays_routes))
    bridge = Bridge(hf_config, shape, config)
    _load_base(chunks, model_dir, weights, bridge)
    return chunks, config, bridge


def _load_base(chunks, model_dir: str, weights: Optional[WeightsSource], bridge: Bridge) -> None:
    if weights is not None:
        load_weights(chunks, weights, bridge)
    else:
        bridge.load(chunks, model_dir)


def _load_adapter(model, adapter: AdapterSource, hf_config: dict, bridge: Bridge) -> LoraConfig:
    """Load `adapter` (PEFT, or an ms-swift one converted to PEFT in a temporary directory)."""
    with tempfile.TemporaryDirectory(prefix="swift_megatron_adapter_") as tmp:
        return load_adapter(model, peft_dir_of(adapter, hf_config, tmp), bridge)


def train_iters(args: RlhfArguments, plan: BatchPlan, num_prompts: int) -> int:
    t = args.training
    return run_length(plan, args.grpo.num_iterations, t.train_iters, t.num_train_epochs,
                      num_prompts)[0]


def attach_lora(args: RlhfArguments, model, bridge: Bridge, adapter: Optional[AdapterSource],
                hf_config: dict) -> Optional[LoraConfig]:
    """--train_type lora / lora_llm: wrap the targeted linears with adapters (new, or `adapter`
    to continue: --adapters / --mcore_adapter) and freeze everything else; before DDP
    wrapping."""
    if not args.training.uses_lora:
        return None
    if adapter is not None:
        return _load_adapter(model, adapter, hf_config, bridge)
    config = LoraConfig.from_arguments(args.lora, seed=args.training.seed)
    apply_lora(model, config, bridge.mappings)
    return config


def optimizer_settings(args: RlhfArguments, iters: int) -> OptimizerSettings:
    """The optimizer and schedule flags, for a run of `iters` optimizer steps."""
    t = args.training
    return OptimizerSettings(
        lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
        use_distributed_optimizer=args.parallel.use_distributed_optimizer,
        optimizer_cpu_offload=t.optimizer_cpu_offload,
        optimizer_offload_fraction=t.optimizer_offload_fraction,
        use_precision_aware_optimizer=t.use_precision_aware_optimizer,
        exp_avg_dtype=t.exp_avg_dtype, exp_avg_sq_dtype=t.exp_avg_sq_dtype,
        apply_wd_to_qk_layernorm=t.apply_wd_to_qk_layernorm,
        overlap_param_gather=args.parallel.overlap_param_gather,
        weight_decay_incr_style=t.weight_decay_incr_style,
        start_weight_decay=t.start_weight_decay, end_weight_decay=t.end_weight_decay,
        train_iters=iters,
        lr_decay_style=t.lr_decay_style, lr_decay_iters=t.lr_decay_iters,
        lr_warmup_iters=t.lr_warmup_iters, lr_warmup_fraction=t.lr_warmup_fraction,
        lr_warmup_init=t.lr_warmup_init, lr_wsd_decay_style=t.lr_wsd_decay_style,
        lr_wsd_decay_iters=t.lr_wsd_decay_iters, vit_lr=t.vit_lr, aligner_lr=t.aligner_lr)


def _check_offload_resume(args: RlhfArguments, start: Start) -> None:
    """checkpoint/trainer.py cannot load the state of megatron's hybrid (host-offloaded)
    optimizer yet (its empty-state initialiser breaks the hybrid optimizer's load hook)."""
    t = args.training
    saved = start.resume_dir and os.path.isdir(os.path.join(start.resume_dir, "optimizer"))
    if t.optimizer_cpu_offload and saved and not t.no_load_optim:
        raise UserError("--optimizer_cpu_offload: resuming the optimizer state of megatron's "
                        "hybrid optimizer is not supported yet; pass --no_load_optim (weights, "
                        "step, RNG and data position still resume)")


def policy(args: RlhfArguments, state: ParallelState, model_dir: str, iters: int,
           start: Start) -> Policy:
    hf_config = load_hf_config(model_dir)
    dtype = training_dtype(args, hf_config, state.device)
    settings = optimizer_settings(args, iters)
    check_settings(settings, state.device, dtype)
    _check_offload_resume(args, start)
    weights = base_weights(args, start)
    chunks, config, bridge = _load_model(args, state, model_dir, hf_config, dtype, weights)
    check_vision_flags(args, hf_config)
    lora = attach_lora(args, chunks[0], bridge, start.adapter, hf_config)  # one chunk with LoRA
    if args.training.train_type == "lora_llm":
        _train_vision_in_full(chunks)
    elif lora is None and has_vision(hf_config):
        m = args.model
        for chunk in chunks:
            freeze(chunk, freeze_llm=m.freeze_llm, freeze_vit=m.freeze_vit,
                   freeze_aligner=m.freeze_aligner)
    elif args.model.freeze_llm and lora is None:
        raise UserError("--freeze_llm true leaves nothing to train: this model has no vision "
                        "tower")
    if args.training.train_type == "full" and args.freeze.active:
        apply_freeze(chunks, FreezeRules.from_arguments(args.freeze))
    p = args.parallel
    ddp = [wrap_ddp(chunk, config, p.use_distributed_optimizer,
                    overlap_grad_reduce=p.overlap_grad_reduce,
                    overlap_param_gather=p.overlap_param_gather) for chunk in chunks]
    overlap_sync_funcs(config, ddp)
    optimizer = build_optimizer(ddp, config, settings)
    scheduler = build_scheduler(optimizer, settings)
    return Policy(ddp, config, bridge, optimizer, scheduler, model_dir, hf_config, dtype, lora)


def _train_vision_in_full(chunks: List[torch.nn.Module]) -> None:
    """--train_type lora_llm (as ms-swift): besides the language model's adapters, every
    parameter of the vision tower and aligner trains (apply_lora froze them)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if vision_part(name) != "llm":
                param.requires_grad_(True)


def frozen_model(args: RlhfArguments, state: ParallelState, model_dir: str, dtype, *,
                 model_type: Optional[str] = None, weights: Optional[WeightsSource] = None,
                 adapter: Optional[AdapterSource] = None,
                 flag: str) -> Tuple[List[torch.nn.Module], Bridge]:
    """The model chunks of a forward-only model of this stage (a reference or a teacher), in
    the policy's parallel layout: weights from `weights` or the HF checkpoint at `model_dir`,
    plus an optional adapter; eval mode, no gradients. `flag` names it in errors."""
    hf_config = load_hf_config(model_dir)
    moe = num_experts(hf_config) is not None   # the expert degrees apply to MoE models only
    try:
        check_layout(hf_config, state.tp, state.pp, state.ep if moe else 1, state.etp if moe else 1,
                     vpp=state.vpp, **args.parallel.uneven_pipeline)
    except UserError as error:
        raise UserError(f"{flag} {model_dir}: {error}") from None
    chunks, config, shape = build_chunks(
        hf_config, dtype, state.device, sequence_parallel=args.parallel.sequence_parallel,
        model_type=model_type, random_init=False, **_config_overrides(args, hf_config))
    bridge = Bridge(hf_config, shape, config)
    _load_base(chunks, model_dir, weights, bridge)
    if adapter is not None:
        _load_adapter(chunks[0], adapter, hf_config, bridge)  # one chunk with adapters
    for chunk in chunks:
        chunk.eval().requires_grad_(False)
    return chunks, bridge


def reference_model(args: RlhfArguments, state: ParallelState, pol: Policy, start: Start,
                    tok) -> Reference:
    """The reference of the KL term (references.py says which), with --sync_ref_model's
    requirements checked."""
    m, g = args.model, args.grpo
    policy_weights = base_weights(args, start)
    # lora_llm trains the vision tower in place: disabling the adapters does not give the
    # starting model, so its reference is a frozen copy as with full training
    source = reference_source(g, args.training.train_type == "lora", policy_weights)
    frozen = None
    if source is not None:
        if source.model_name:
            directory = resolve_model_dir(source.model_name, m.use_hf, None)
        elif source.weights is not None and source.weights is not policy_weights:
            directory = _hf_dir(source.weights, m.use_hf, "--mcore_ref_model")
        else:
            directory = pol.model_dir
        if directory != pol.model_dir:
            check_same_tokenizer(directory, tok, "--ref_model")
        frozen, _ = frozen_model(args, state, directory, pol.dtype, weights=source.weights,
                                 adapter=source.adapter, flag="--ref_model")
    if g.sync_ref_model and (frozen is None or pol.lora is not None):
        raise UserError("--sync_ref_model true mixes the policy into a frozen reference: it needs "
                        "--train_type full")
    return Reference(frozen, pol.chunks, g.offload_ref_model)


def teacher(args: RlhfArguments, state: ParallelState, pol: Policy, tok) -> Optional[Teacher]:
    """--teacher_model (on-policy distillation), loaded in the policy's layout, or None."""
    g = args.grpo
    if g.teacher_model is None:
        return None
    directory = resolve_model_dir(g.teacher_model, args.model.use_hf, g.teacher_model_revision)
    check_same_tokenizer(directory, tok)
    chunks, bridge = frozen_model(args, state, directory, pol.dtype,
                                  model_type=g.teacher_model_type, flag="--teacher_model")
    return Teacher(chunks, bridge.shape.vocab_size, g.offload_teacher_model)


def tokenizer(model_dir: str, hf_config: dict):
    """The checkpoint's tokenizer; UserError when it has more tokens than the model's embedding
    rows (an id past them would fail deep in the first rollout)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = text_config(hf_config)["vocab_size"]
    if len(tok) > vocab:
        raise UserError(f"{model_dir}: the tokenizer has {len(tok)} tokens but the model's "
                        f"vocab_size is {vocab}: they come from different models (check the "
                        "tokenizer files and config.json)")
    return tok


def eos_token_ids(model_dir: str, tok) -> List[int]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids:
        raise UserError(f"{model_dir}: the tokenizer has no eos token; generation could not stop")
    return sorted(ids)


def image_encoder(args: RlhfArguments, model_dir: str, hf_config: dict) -> Optional[ImageEncoder]:
    """A vision-language model's image processor (--max_pixels / MAX_PIXELS); None for a text
    model, or one whose directory has no image processor (preprocessor_config.json: images are
    then refused as for a text model)."""
    if not takes_images(model_dir, hf_config):
        return None
    return ImageEncoder(model_dir, hf_config, resolve_max_pixels(args.data.max_pixels))


def prompts(args: RlhfArguments, tok, hf_config: dict,
            images: Optional[ImageEncoder] = None) -> Tuple[List[Prompt], List[Prompt]]:
    flat = SimpleNamespace(**vars(args.data), max_completion_length=args.grpo.max_completion_length,
                           use_hf=args.model.use_hf, seed=args.training.seed)
    return prepare_prompts(flat, tok, max_position_embeddings=text_config(hf_config).get(
        "max_position_embeddings"), images=images)


def sync_filter(args: RlhfArguments, pol: Policy) -> Optional[Callable[[str], bool]]:
    """Which exported tensors a weight sync after the first one sends: without the frozen parts
    of a vision tower (they never change; the first sync sends everything). None: all of them,
    also when the colocated vLLM discards its weights while training (--sleep_level 2)."""
    if not has_vision(pol.hf_config) or args.rollout.sleep_level == 2:
        return None
    frozen = dict(frozen_vision_parts(args.model, args.training), llm=False)
    if not (frozen["vit"] or frozen["aligner"]):
        return None
    return lambda name: not frozen[vision_part(name)]


def check_images(args: RlhfArguments, state: ParallelState, prompts: List[Prompt],
                 server_scheduler: Optional[str] = None) -> None:
    """Refuse what prompts with images do not support yet (docs/multimodal.md): before the
    model is built, and again once the rollout servers named their scheduler."""
    if not any(p.images for p in prompts):
        return
    if state.cp > 1:
        raise UserError("--context_parallel_size > 1 with images is not supported yet")
    if args.grpo.multi_turn_scheduler or server_scheduler:
        raise UserError("multi-turn rollouts with images are not supported yet")


def samplers(args: RlhfArguments, plan: BatchPlan, state: ParallelState,
             train: List[Prompt]) -> Tuple[PromptSampler, Callable[[int], List[Prompt]]]:
    """The rollout sampler, and the source of fresh prompts for dynamic sampling."""
    sampler = PromptSampler(len(train), plan.rollout_prompts, state.dp, state.dp_rank,
                            seed=args.training.seed, shuffle=args.data.dataset_shuffle,
                            step_prompts=plan.global_batch_size / plan.num_generations)
    spare = PromptSampler(len(train), 1, seed=args.training.seed + 1_000_003 + state.dp_rank)
    position = {"next": 0}

    def fresh(count: int) -> List[Prompt]:
        indices = spare.stream(position["next"], count)
        position["next"] += count
        return [train[i] for i in indices]

    return sampler, fresh


def engine(args: RlhfArguments, state: ParallelState, pol: Policy, tok, prompts: List[Prompt]):
    """The rollout engine the flags ask for: embedded, vLLM colocate or vLLM servers."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eng = build_engine(args, model_dir=pol.model_dir, device=state.device, dtype=pol.dtype,
                       eos_token_ids=eos_token_ids(pol.model_dir, tok), pad_token_id=pad,
                       images=any(p.images for p in prompts),
                       full_syncs=sync_filter(args, pol) is None)
    adopt_server_gym_reward(args, getattr(eng, "server_use_gym_env", False))
    check_multi_turn_sources(args, getattr(eng, "server_scheduler", None))
    check_images(args, state, prompts, getattr(eng, "server_scheduler", None))
    return eng


def adopt_server_gym_reward(args: RlhfArguments, server_use_gym_env: bool) -> None:
    """Rollout servers started with --use_gym_env supply each episode's environment reward:
    the trainer adds its gym_reward column unless --use_gym_env was given here (as ms-swift's
    trainer takes it from the server)."""
    if server_use_gym_env and "use_gym_env" not in args.explicit:
        args.grpo.use_gym_env = True
        logger.info("the rollout servers supply the gym environment's reward (megatron rollout "
                    "--use_gym_env): reward column gym_reward")


def check_multi_turn_sources(args: RlhfArguments, server_scheduler: Optional[str]) -> None:
    """One multi-turn scheduler at most: ours (--multi_turn_scheduler) or the rollout
    servers' (`server_scheduler`); --use_gym_env needs one of them; no --async_generate with
    the servers' (checked before the trainer opens anything on them)."""
    g = args.grpo
    if server_scheduler is not None and g.multi_turn_scheduler is not None:
        raise UserError(f"the rollout servers run the multi-turn scheduler {server_scheduler} "
                        f"(megatron rollout --multi_turn_scheduler): drop --multi_turn_scheduler "
                        f"{g.multi_turn_scheduler} here, or start the servers without one")
    if server_scheduler is not None and g.async_generate:
        raise UserError(f"--async_generate true does not support multi-turn rollouts, and the "
                        f"rollout servers run the scheduler {server_scheduler}: drop "
                        "--async_generate, or start the servers without --multi_turn_scheduler")
    if g.use_gym_env and g.multi_turn_scheduler is None and server_scheduler is None:
        raise UserError("--use_gym_env true: the rollout servers run no multi-turn scheduler "
                        "(start them with --multi_turn_scheduler gym_scheduler --gym_env ...)")


def offloaders(args: RlhfArguments, state: ParallelState, pol: Policy, reference) -> list:
    """Colocate mode: what moves to host memory while vLLM generates (--offload_model: the
    policy and `reference`, a list of the other models' chunks; else the policy's gradients
    alone are freed; --offload_optimizer). Without the colocated engine: none, and the colocate
    flags' notice when preflight expected it."""
    if engine_kind(args, state.device) != "colocate":
        note = note_no_colocate_engine(args)
        if note and state.rank == 0:
            logger.warning(note)
        return []
    moved = []
    if args.rollout.offload_model:
        moved.append(model_offloader(pol.chunks + (reference or [])))
    else:
        moved.append(grad_dropper(pol.chunks))
    if args.rollout.offload_optimizer:
        moved.append(optimizer_offloader(pol.optimizer))
    return moved


def rewards(args: RlhfArguments, device: torch.device = torch.device("cpu")):
    """--reward_funcs then --reward_model (loaded on `device`) as [(name, callable)], after
    importing --external_plugins. Reward classes get, besides their RewardConfig values,
    `args`: every flag of the run as an attribute (what ms-swift's ORM classes receive)."""
    g = args.grpo
    check_reward_sources(args, servers_asked=True)
    plugins = load_plugins(g.external_plugins)
    funcs = resolve_reward_funcs(g.reward_funcs, plugins, RewardConfig.from_args(g),
                                 init_kwargs={"args": flat_args(args)}) if g.reward_funcs else []
    funcs += reward_model_funcs(g.reward_model, g.reward_model_plugin, device,
                                use_hf=args.model.use_hf,
                                attn_implementation=args.model.attn_implementation)
    if g.use_gym_env:
        from swift_megatron.rollout.multi_turn.gym import gym_reward

        funcs.append(("gym_reward", gym_reward))
    return funcs


def multi_turn_scheduler(args: RlhfArguments, tok, hf_config: dict, server_scheduler=None):
    """--multi_turn_scheduler (None without one) and the turn budget (also for the rollout
    servers' scheduler, `server_scheduler`). Call after the plugins are loaded (rewards()):
    they may register schedulers and environments."""
    g = args.grpo
    from swift_megatron.rollout import multi_turn
    from swift_megatron.rollout.plugin_registry import GYM_ENVS

    if g.gym_env is not None:
        GYM_ENVS.lookup(g.gym_env)   # a typo fails here, not at the first rollout
    d = args.data
    kwargs = {} if d.enable_thinking is None else {"enable_thinking": d.enable_thinking}
    settings = multi_turn.MultiTurnSettings(
        max_completion_length=g.max_completion_length,
        max_length=d.max_length or hf_config.get("max_position_embeddings") or 2**31 - 1,
        max_turns=g.max_turns, limit_scope=g.completion_length_limit_scope,
        template_kwargs=kwargs, agent_template=d.agent_template)
    if g.multi_turn_scheduler is None:
        return None, settings
    return multi_turn.build_scheduler(g.multi_turn_scheduler, max_turns=g.max_turns,
                                      tokenizer=tok, args=flat_args(args)), settings


def collector(args: RlhfArguments, state: ParallelState, eng, tok, reward_funcs,
              fresh: Callable[[int], List[Prompt]], hf_config: Optional[dict] = None,
              images: Optional[ImageEncoder] = None) -> RolloutCollector:
    g = args.grpo
    multi_turn, turn_settings = multi_turn_scheduler(
        args, tok, hf_config or {}, getattr(eng, "server_scheduler", None))
    sampling = SamplingConfig(max_tokens=g.max_completion_length, temperature=g.temperature,
                              top_p=g.top_p, top_k=g.top_k, repetition_penalty=g.repetition_penalty)
    settings = CollectSettings(
        num_generations=g.num_generations, sampling=sampling,
        reward_names=[name for name, _ in reward_funcs],
        reward_weights=g.reward_weights or [1.0] * len(reward_funcs),
        scale_rewards=g.scale_rewards, dynamic_sample=g.dynamic_sample,
        max_resample_times=g.max_resample_times, advantage_estimator=g.advantage_estimator,
        kl_beta=g.beta if g.kl_in_reward else 0.0, multi_turn=turn_settings,
        reward_error_policy=g.reward_error_policy)
    return RolloutCollector(eng, reward_funcs, tok, settings, state.mp_group, state.dp_group,
                            fresh, state.device, scheduler=multi_turn, images=images)


def loss_settings(args: RlhfArguments, pol: Policy) -> LossSettings:
    g = args.grpo
    return LossSettings(loss_type=g.loss_type, beta=g.beta, epsilon=g.epsilon,
                        epsilon_high=g.epsilon_high, delta=g.delta,
                        importance_sampling_level=g.importance_sampling_level,
                        temperature=g.temperature, max_completion_length=g.max_completion_length,
                        vocab_size=pol.bridge.shape.vocab_size,
                        rollout_correction=g.rollout_importance_sampling_mode,
                        rollout_correction_threshold=g.rollout_importance_sampling_threshold,
                        offpolicy_metrics=bool(g.log_rollout_offpolicy_metrics
                                               or g.rollout_importance_sampling_mode),
                        tau_pos=g.tau_pos, tau_neg=g.tau_neg, real_tau=g.real_tau,
                        fipo=FipoSettings(g.fipo_decay_rate, g.fipo_clip_range,
                                          g.fipo_clip_high_only, g.fipo_safety_threshold),
                        num_generations=g.num_generations, kl_in_reward=g.kl_in_reward,
                        top_entropy_quantile=g.top_entropy_quantile, log_entropy=g.log_entropy,
                        off_policy_sequence_mask_delta=g.off_policy_sequence_mask_delta,
                        teacher_kl_coef=g.teacher_kl_coef)


def output_dir(args: RlhfArguments, state: ParallelState) -> str:
    """--output_dir (default megatron_output/<model name>), inside a new v<N>-<time> directory
    unless --add_version false, as ms-swift; chosen on rank 0 and shared."""
    import torch.distributed as dist

    t = args.training
    base = output_base(t.output_dir, args.model.model or t.mcore_model)
    chosen = [versioned(base) if t.add_version else base]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def claim_run_dirs(args: RlhfArguments, state: ParallelState, out: str,
                   resume_dir: Optional[str]) -> RunLock:
    """Create and lock the run's directories on global rank 0 (checkpoint/run_dir.py); a
    refusal there is raised on every rank. Collective."""
    import torch.distributed as dist

    lock, refusal = RunLock(), [None]
    if state.rank == 0:
        try:
            for flag, directory in run_dirs(out, args.training.save):
                claim_run_dir(lock, directory, flag, [resume_dir])
        except UserError as error:
            refusal[0] = str(error)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise UserError(refusal[0])
    return lock


def versioned(base: str) -> str:
    """base/v<N>-<YYYYMMDD-HHMMSS>, N one more than the highest existing version."""
    versions = [int(name[1:].split("-")[0]) for name in os.listdir(base)
                if name.startswith("v") and name[1:].split("-")[0].isdigit()] \
        if os.path.isdir(base) else []
    return os.path.join(base, f"v{max(versions, default=-1) + 1}-{time.strftime('%Y%m%d-%H%M%S')}")


def eval_steps(args: RlhfArguments, has_validation: bool) -> Optional[int]:
    """--eval_steps, by default --save_steps when there are validation prompts (ms-swift); none
    with --eval_iters 0;
    without validation prompts no evaluation runs, as in ms-swift (whose examples pass
    --eval_steps without any), with a one-line note when the flag was given."""
    t = args.training
    if t.eval_iters == 0:   # ms-swift's way to turn evaluation off
        return None
    if not has_validation:
        if t.eval_steps:
            logger.info(f"--eval_steps {t.eval_steps}: no validation prompts (--val_dataset or "
                        f"--split_dataset_ratio), so no evaluation runs")
        return None
    return t.eval_steps or t.save_steps


def loggers(args: RlhfArguments, state: ParallelState, out: str, run_config: dict):
    t, enabled = args.training, state.rank == 0
    sinks = SinkSettings(tensorboard_dir=t.tensorboard_dir, wandb_project=t.wandb_project,
                         wandb_exp_name=t.wandb_exp_name, swanlab_project=t.swanlab_project,
                         swanlab_exp_name=t.swanlab_exp_name)
    metrics = MetricsLogger(out, t.report_to, run_config=run_config, enabled=enabled, sinks=sinks)
    completions = CompletionsLogger(out, enabled=enabled and args.grpo.log_completions)
    return metrics, completions


def base_weights(args: RlhfArguments, start: Start) -> Optional[WeightsSource]:
    """The policy's starting weights when not --model's HF checkpoint: --mcore_model's, or (no
    --model) those kept in a LoRA checkpoint of ours beside its adapter."""
    if start.weights is not None:
        return start.weights
    if args.model.model is None and start.adapter is not None:
        return start.adapter.base
    return None


def _hf_dir(weights: WeightsSource, use_hf: bool, flag: str) -> str:
    """The HF directory (config.json, tokenizer) describing `weights`: kept beside them, or the
    base model an ms-swift checkpoint's args.json names."""
    if weights.hf_files:
        return weights.hf_files
    if weights.base_model:
        return resolve_model_dir(weights.base_model, use_hf, None)
    raise UserError(f"{flag}: the {weights.describe()} holds no config.json and names no base "
                    "model: pass --model (the HF model it was trained from)")


def model_dir(args: RlhfArguments, start: Start) -> str:
    """The HF directory of config and tokenizer: --model (downloaded for a hub id; checked with
    --check_model), else the HF files kept with the starting checkpoint, else the base model
    that checkpoint names."""
    m = args.model
    if m.model is not None:
        directory = resolve_model_dir(m.model, m.use_hf, m.model_revision)
        if m.check_model and base_weights(args, start) is None:
            check_model_dir(directory)
        return directory
    weights = base_weights(args, start)
    if weights is not None:
        return _hf_dir(weights, m.use_hf, "--mcore_model")
    if start.adapter is not None and start.adapter.base_model:
        return resolve_model_dir(start.adapter.base_model, m.use_hf, None)
    if start.resume_dir and os.path.isfile(os.path.join(layout_hf_dir(start.resume_dir),
                                                        "config.json")):
        return layout_hf_dir(start.resume_dir)
    raise UserError("pass --model: the starting checkpoint names no base model")
