"""Wrap model chunks in megatron's DDP, build megatron's optimizer (Adam, grad clipping, fp32 main
params for bf16, optional distributed optimizer) and its warmup + decay learning-rate schedule."""
from dataclasses import dataclass
from typing import List, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


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
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    train_iters: int = 1


def wrap_ddp(model: torch.nn.Module, config, use_distributed_optimizer: bool) -> DistributedDataParallel:
    """Megatron DDP: contiguous fp32 grad buffers, DP all-reduce (or reduce-scatter for the
    distributed optimizer) in finalize_model_grads, which is also installed on the config (it
    all-reduces tied embeddings across PP stages and layer norms across TP)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(chunks: List[DistributedDataParallel], config, settings: OptimizerSettings):
    opt_config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=settings.min_lr,
        weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps, clip_grad=settings.clip_grad,
        bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, chunks)
    return optimizer


def build_scheduler(optimizer, settings: OptimizerSettings,
                    warmup_fraction: Optional[float] = None) -> OptimizerParamScheduler:
    """Linear warmup from 0 to lr, then cosine/linear/constant decay to min_lr over train_iters."""
    warmup = (int(warmup_fraction * settings.train_iters) if warmup_fraction is not None
              else settings.lr_warmup_iters)
    warmup = min(warmup, max(settings.train_iters - 1, 0))
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else settings.lr, max_lr=settings.lr,
        min_lr=settings.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(settings.train_iters, warmup + 1),
        lr_decay_style=settings.lr_decay_style, start_wd=settings.weight_decay,
        end_wd=settings.weight_decay, wd_incr_steps=settings.train_iters, wd_incr_style="constant")
