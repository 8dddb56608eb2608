"""Wrap model chunks in megatron's DDP, build megatron's optimizer (Adam, grad clipping, fp32 main
params for bf16, optional distributed optimizer, optional host offload of its state) and its
warmup + decay learning-rate schedule (megatron's OptimizerParamScheduler).

What megatron-core 0.16.1 needs, checked up front by `check_settings` (a UserError naming the
flags instead of an assertion or a KeyError deep inside megatron); measured on an H100 with
tests/gpu/test_optimizer_offload_gpu.py:
- `--optimizer_cpu_offload` (megatron's HybridDeviceOptimizer) offloads the state of CUDA
  parameters only (a CPU run has nothing to offload: the optimizer already runs on the host).
  It needs the distributed optimizer (the bf16 optimizer without it swaps in parameters the
  hybrid optimizer does not know: KeyError at the first step), bf16/fp16 training (float32
  shards are views of the model's parameters, which a torch optimizer refuses), and
  `--use_precision_aware_optimizer`, as Megatron-LM requires: only then do the float32 main
  parameters move to the host too, and only then does a checkpointed state load back.
- `--use_precision_aware_optimizer` needs the distributed optimizer. megatron-core 0.16.1's own
  precision-aware path needs Transformer Engine's FusedAdam (torch's AdamW takes no state
  dtypes) unless the hybrid (offload) optimizer takes its place, so megatron is asked for it
  only with --optimizer_cpu_offload; otherwise training/adam_states.py keeps Adam's moments in
  --exp_avg_dtype / --exp_avg_sq_dtype. megatron-core 0.16.1 also asks Transformer Engine's
  version for every precision-aware config and fails without it: `_no_te_is_old_te` answers.

The schedule, in optimizer steps (megatron's own arithmetic; `schedule_steps` is pure):
warmup from --lr_warmup_init to --lr over --lr_warmup_iters steps (or --lr_warmup_fraction of
--lr_decay_iters), then --lr_decay_style down to --min_lr at --lr_decay_iters (default
--train_iters), --min_lr after that. WSD holds --lr until the last --lr_wsd_decay_iters steps
of the decay and decays in --lr_wsd_decay_style there.
"""
import contextlib
import importlib.util
from dataclasses import dataclass
from typing import List, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate
from megatron.core.optimizer import optimizer_config as _optimizer_config_module
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, ParamGroupOverride

from swift_megatron.arguments.training import check_lr_bounds
from swift_megatron.errors import UserError
from swift_megatron.model.wrappers import unwrap
from swift_megatron.platform.cuda_paths import takes_cuda_paths
from swift_megatron.training.adam_states import keep_states_in


@dataclass
class OptimizerSettings:
    """The optimizer and schedule knobs (filled from TrainingArguments by the trainer)."""

    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    use_precision_aware_optimizer: bool = False
    exp_avg_dtype: str = "fp32"               # with use_precision_aware_optimizer: "bf16" too
    exp_avg_sq_dtype: str = "fp32"
    apply_wd_to_qk_layernorm: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # schedule, in optimizer steps
    train_iters: int = 1
    lr_decay_style: str = "cosine"
    lr_decay_iters: Optional[int] = None      # None: train_iters
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None  # of lr_decay_iters; wins over lr_warmup_iters
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: Optional[int] = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: Optional[float] = None  # None: weight_decay
    end_weight_decay: Optional[float] = None
    # vision-language models: peak learning rates of the vision tower and the aligner
    vit_lr: Optional[float] = None            # None: lr
    aligner_lr: Optional[float] = None        # None: lr


def wrap_ddp(model: torch.nn.Module, config, use_distributed_optimizer: bool, *,
             overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
             bucket_size: Optional[int] = None) -> DistributedDataParallel:
    """Megatron DDP: contiguous fp32 grad buffers, DP all-reduce (or reduce-scatter for the
    distributed optimizer) in finalize_model_grads, which is also installed on the config (it
    all-reduces tied embeddings across PP stages and layer norms across TP).

    `overlap_grad_reduce`: each bucket's reduction starts in the last micro-batch's backward as
    soon as its gradients are ready (DDP's backward hooks; `overlap_sync_funcs` tells the
    schedule); every parameter is marked `grad_to_ddp_hook`, so that the layers that add their
    gradient into `main_grad` themselves (the LoRA branch, the logprob head) hand it to autograd
    instead and DDP's hook counts it. `overlap_param_gather` (distributed optimizer): the
    all-gather of the updated parameters waits for the next forward pass, bucket by bucket
    (training/step.py `gather_params` finishes it for readers outside a forward).
    `bucket_size`: elements per bucket (megatron's default: one bucket of 40M+ with overlap,
    all parameters without)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather, bucket_size=bucket_size,
        use_distributed_optimizer=use_distributed_optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:
        for param in model.parameters():
            param.grad_to_ddp_hook = True
    ddp = DistributedDataParallel(config, ddp_config, model)
    if ddp.use_forward_hook:
        _wait_for_unrun_modules(ddp)
    return ddp


def _wait_for_unrun_modules(ddp: DistributedDataParallel) -> None:
    """With the overlapped all-gather megatron's forward pre-hook waits for a module's own
    parameters when the module runs. Two kinds never run: a ParameterDict (LoRA's adapters),
    whose parent's forward waits for it, and the output layer, whose weight the logprob head
    reads directly (model/head.py), for which the model's forward waits."""
    hook = ddp._make_forward_pre_hook()
    waits = [(parent, child) for parent in ddp.module.modules() for child in parent.children()
             if isinstance(child, (torch.nn.ParameterDict, torch.nn.ParameterList))]
    gpt = unwrap(ddp)
    if getattr(gpt, "output_layer", None) is not None:
        waits.append((gpt, gpt.output_layer))
    for parent, child in waits:
        parent.register_forward_pre_hook(lambda module, *unused, c=child: hook(c))


def overlap_sync_funcs(config, chunks: List[DistributedDataParallel]) -> None:
    """With --overlap_grad_reduce: the schedule runs every micro-batch but the last under each
    chunk's `no_sync`, so DDP's hooks start a bucket's reduction only once its gradients are
    complete, in the last micro-batch's backward. Every trained parameter must get a gradient
    in every step (megatron waits for each one it counted in the first step)."""
    if chunks and chunks[0].ddp_config.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in chunks]
        config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync


# ---- optimizer -------------------------------------------------------------------------------

def _te_fused_adam_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def check_settings(settings: OptimizerSettings, device: torch.device, dtype: torch.dtype) -> None:
    """UserError, before any model is built, for settings megatron-core 0.16.1 cannot run in
    this configuration (see the module docstring) and for a schedule that does not fit."""
    check_lr_bounds(settings)
    schedule_steps(settings)
    if settings.optimizer_cpu_offload:
        _check_cpu_offload(settings, device, dtype)


def _check_cpu_offload(settings: OptimizerSettings, device: torch.device,
                       dtype: torch.dtype) -> None:
    """The device and dtype rules (the flag combinations are checked with the flags:
    arguments/commands.py)."""
    if device.type != "cuda":
        raise UserError("--optimizer_cpu_offload needs CUDA: megatron-core's hybrid optimizer "
                        "moves the optimizer state of GPU parameters to host memory, and on a "
                        "CPU run it already is there; drop the flag")
    if dtype == torch.float32:
        raise UserError("--optimizer_cpu_offload needs bf16 or fp16 training (--torch_dtype "
                        "bfloat16): megatron-core 0.16.1's hybrid optimizer cannot take the "
                        "distributed optimizer's float32 parameter shards")


@contextlib.contextmanager
def _no_te_is_old_te():
    """megatron-core 0.16.1's OptimizerConfig calls is_te_min_version("2.1.0") for every
    precision-aware config, which raises TypeError when Transformer Engine is not installed:
    without it, every minimum version is unmet."""
    original = _optimizer_config_module.is_te_min_version
    if not _te_fused_adam_available():
        _optimizer_config_module.is_te_min_version = lambda *args, **kwargs: False
    try:
        yield
    finally:
        _optimizer_config_module.is_te_min_version = original


def optimizer_config(settings: OptimizerSettings, config) -> OptimizerConfig:
    """megatron's OptimizerConfig for these settings and the model's TransformerConfig."""
    with _no_te_is_old_te():
        return OptimizerConfig(
            optimizer="adam", lr=settings.lr, min_lr=settings.min_lr,
            weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
            clip_grad=settings.clip_grad, bf16=config.bf16, fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            optimizer_cpu_offload=settings.optimizer_cpu_offload,
            optimizer_offload_fraction=settings.optimizer_offload_fraction,
            apply_wd_to_qk_layernorm=settings.apply_wd_to_qk_layernorm,
            overlap_param_gather=settings.overlap_param_gather,
            # megatron's own precision-aware path needs Transformer Engine's FusedAdam, except
            # in its hybrid (host-offload) optimizer; elsewhere adam_states.py keeps the states
            use_precision_aware_optimizer=settings.use_precision_aware_optimizer
            and settings.optimizer_cpu_offload)


def _vision_part_key(part: str) -> ParamKey:
    """Matches the parameters of one part ("vit" or "aligner") of a vision-language model
    (names as the DDP-wrapped chunk gives them: `module.visual....`)."""
    from swift_megatron.model.vision import vision_part

    return ParamKey(with_name_predicate=ParamWithNamePredicate(
        name=f"vision_{part}",
        fn=lambda param, name: vision_part(name.removeprefix("module.")) == part))


def param_group_overrides(settings: OptimizerSettings, config: OptimizerConfig) -> dict:
    """megatron's per-parameter-group settings: its standard ones (no weight decay on biases
    and 1-D parameters) and, as ms-swift, --vit_lr / --aligner_lr as the peak learning rate of
    their part, whose minimum scales the same way (min_lr x vit_lr / lr): the part follows the
    --lr schedule times vit_lr / lr (warmup starts from --lr_warmup_init for every group, as
    megatron-core 0.16's scheduler does)."""
    overrides = get_standard_config_overrides(config)
    for part, lr in (("vit", settings.vit_lr), ("aligner", settings.aligner_lr)):
        if lr is not None and lr != settings.lr:
            overrides[_vision_part_key(part)] = ParamGroupOverride(
                max_lr=lr, min_lr=settings.min_lr * lr / settings.lr)
    return overrides


def build_optimizer(chunks: List[DistributedDataParallel], config, settings: OptimizerSettings):
    opt_config = optimizer_config(settings, config)
    optimizer = get_megatron_optimizer(opt_config, chunks,
                                       config_overrides=param_group_overrides(settings, opt_config))
    use_fused_adam(optimizer)
    if (settings.exp_avg_dtype, settings.exp_avg_sq_dtype) != ("fp32", "fp32"):
        keep_states_in(torch_optimizers(optimizer), settings.exp_avg_dtype,
                       settings.exp_avg_sq_dtype)
    return optimizer


def torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron (chained) optimizer."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [part.optimizer for part in parts if getattr(part, "optimizer", None) is not None]


def use_fused_adam(optimizer) -> None:
    """Switch every torch Adam(W) inside `optimizer` whose parameters all live on CUDA (or on the
    CPU in the tests' platform/cuda_paths.py `on_cpu()`: torch's fused CPU kernel) to torch's
    fused kernel. Without Transformer Engine or apex megatron-core 0.16.1 builds
    torch.optim.AdamW and leaves torch to pick its foreach implementation, whose step allocates
    a temporary the size of the float32 second moments (1.54B parameters: 5.8 GiB, the peak of a
    GRPO step with full recomputation); the fused kernel updates in one pass without it. The
    update is the same to float32 rounding. The hybrid (host-offload) optimizer is left alone.
    Adam's `step` of a fused group lives on the parameters' device: state that already exists
    (a loaded checkpoint) needs its `step` placed again (`adam_step_tensor`; load_checkpoint
    does)."""
    for inner in torch_optimizers(optimizer):
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if params and all(takes_cuda_paths(p.device) for p in params):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False


def adam_step_tensor(step: float, param: torch.Tensor, fused: Optional[bool]) -> torch.Tensor:
    """Adam's per-parameter `step` as torch keeps it: float32, on the parameter's device for
    the fused kernel, on the host otherwise."""
    return torch.tensor(step, dtype=torch.float32, device=param.device if fused else "cpu")


# ---- schedule --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScheduleSteps:
    """The step counts OptimizerParamScheduler takes (warmup may be fractional, as megatron's)."""

    warmup: float
    decay: int
    wsd_decay: Optional[int]


def schedule_steps(settings: OptimizerSettings) -> ScheduleSteps:
    """Warmup, decay and WSD-decay lengths in optimizer steps; UserError when they do not fit."""
    decay = settings.lr_decay_iters or settings.train_iters
    if settings.lr_warmup_fraction is not None:
        warmup, source = settings.lr_warmup_fraction * decay, "--lr_warmup_fraction"
    else:
        warmup, source = settings.lr_warmup_iters, "--lr_warmup_iters"
    decay_source = "--lr_decay_iters" if settings.lr_decay_iters else "--train_iters"
    if warmup >= decay:
        raise UserError(f"{source}: the warmup ({warmup:g} steps) must end before the decay does "
                        f"({decay_source} {decay}); shorten the warmup or pass a larger "
                        "--lr_decay_iters")
    wsd = settings.lr_wsd_decay_iters if settings.lr_decay_style == "WSD" else None
    if wsd is not None and wsd > decay - warmup:
        raise UserError(f"--lr_wsd_decay_iters {wsd} is longer than the steps between the "
                        f"warmup and the end of the decay ({decay_source} {decay} - warmup "
                        f"{warmup:g})")
    return ScheduleSteps(warmup=warmup, decay=decay, wsd_decay=wsd)


def build_scheduler(optimizer, settings: OptimizerSettings) -> OptimizerParamScheduler:
    """megatron's schedule (see the module docstring); weight decay goes from
    --start_weight_decay to --end_weight_decay over the run by --weight_decay_incr_style
    (constant: --weight_decay)."""
    check_lr_bounds(settings)
    steps = schedule_steps(settings)
    constant = settings.weight_decay_incr_style == "constant"
    start_wd = settings.weight_decay if constant else settings.start_weight_decay
    end_wd = settings.weight_decay if constant else settings.end_weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=settings.lr_warmup_init, max_lr=settings.lr, min_lr=settings.min_lr,
        lr_warmup_steps=steps.warmup, lr_decay_steps=steps.decay,
        lr_decay_style=settings.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=settings.train_iters, wd_incr_style=settings.weight_decay_incr_style,
        wsd_decay_steps=steps.wsd_decay, lr_wsd_decay_style=settings.lr_wsd_decay_style)
