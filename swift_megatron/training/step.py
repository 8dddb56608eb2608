"""One pass over a list of micro-batches through megatron's forward_backward_func (pipelined
when PP > 1, interleaved over the model chunks with a virtual pipeline), and one optimizer step.

A micro-batch is a dict with `tokens` [b, s] and `position_ids` [b, s] plus whatever the loss
function needs (a vision-language model's also `pixel_values`, `image_grid_thw` and
`prompt_mask`, passed to the model, with 3-D M-RoPE `position_ids` [3, b, s]); a packed one
(rlhf/grpo/batch.py) also has `cu_seqlens` and `max_seqlen`, which become megatron's THD
PackedSeqParams. With context parallelism the model reads this CP rank's
share of the positions (parallel/context.py). A micro-batch with routes (`routed_experts`, or
R2's `recorded_routes`) has the policy's MoE routers replay them (model/routing_replay.py).
`loss_fn(micro_batch, output)` runs on the last
pipeline stage with the final hidden states of those positions and the output layer
(model/head.py `FinalHidden`: logprobs chunk by chunk, or the logits) and returns
`(loss, metrics)`; megatron divides the returned loss by the number of micro-batches and DDP
averages gradients over data-parallel ranks, so a loss that is already this micro-batch's
contribution to the step must be multiplied by micro-batches x DP size (`contribution_scale`).
"""
import contextlib
import math
from functools import partial
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

from swift_megatron.model.head import FinalHidden, hidden_states_out
from swift_megatron.model.routing_replay import end_pass, replaying
from swift_megatron.model.vision import IMAGE_KEYS
from swift_megatron.model.wrappers import unwrap
from swift_megatron.parallel.context import CPShare

LossFn = Callable[[dict, FinalHidden], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]


def packed_seq_params(micro_batch: dict):
    """megatron's THD parameters of a packed micro-batch, None for a padded one."""
    if "cu_seqlens" not in micro_batch:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, longest = micro_batch["cu_seqlens"], micro_batch["max_seqlen"]
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _forward_step(loss_fn: LossFn, data_iterator, model):
    micro_batch = next(data_iterator)
    tokens, positions = micro_batch["tokens"], micro_batch["position_ids"]
    share = CPShare.of(micro_batch)
    if share is not None:  # this CP rank's share of the sequence (parallel/context.py)
        tokens, positions = share.local(tokens, 1), share.local(positions, 1)
    images = {key: micro_batch[key] for key in IMAGE_KEYS if key in micro_batch}
    gpt = unwrap(model)
    with hidden_states_out(gpt), replaying(model, micro_batch, share, gpt.config.sequence_parallel):
        output = model(tokens, positions, attention_mask=None,
                       packed_seq_params=packed_seq_params(micro_batch), **images)
    return output, partial(_loss_adapter, loss_fn, micro_batch, gpt)


def _loss_adapter(loss_fn: LossFn, micro_batch: dict, gpt: torch.nn.Module,
                  hidden: torch.Tensor):
    loss, metrics = loss_fn(micro_batch, FinalHidden(hidden, gpt))
    # megatron rescales the returned tensor in place: hand it a tensor nobody else reads.
    return loss.clone(), metrics


def forward_backward(chunks: Sequence[torch.nn.Module], micro_batches: List[dict],
                     loss_fn: LossFn, forward_only: bool = False) -> List[Dict[str, torch.Tensor]]:
    """Run every micro-batch forward (and backward unless forward_only); returns the metrics
    dict of each micro-batch on the last pipeline stage (an empty list elsewhere).

    A forward-only pass runs the chunks in eval mode (dropout off, e.g. LoRA's): the old-policy,
    reference and weight-sync logprobs are the policy's own, not a dropout sample of it.

    With several model chunks (the interleaved schedule) every micro-batch must have one shape,
    and their number be a multiple of PP: a forward-only pass is topped up with copies of its
    last micro-batch (their outputs dropped); a training pass must already be."""
    if forward_only:
        with _eval_mode(chunks):
            return _run(chunks, micro_batches, loss_fn, True)
    return _run(chunks, micro_batches, loss_fn, False)


@contextlib.contextmanager
def _eval_mode(chunks: Sequence[torch.nn.Module]):
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, mode in zip(chunks, modes):
            chunk.train(mode)


def _run(chunks, micro_batches: List[dict], loss_fn: LossFn, forward_only: bool):
    count = len(micro_batches)
    seq_length = max(mb["tokens"].shape[1] for mb in micro_batches)
    if len(chunks) > 1:
        micro_batches = _interleavable(micro_batches, forward_only)
        # the interleaved schedule runs each model chunk's forward step with its own iterator
        data = [iter(micro_batches) for _ in chunks]
    else:
        data = iter(micro_batches)
    try:
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_fn), data_iterator=data,
            model=list(chunks), num_microbatches=len(micro_batches), seq_length=seq_length,
            micro_batch_size=micro_batches[0]["tokens"].shape[0],
            forward_only=forward_only)[:count]
    finally:
        end_pass(chunks)


def _interleavable(micro_batches: List[dict], forward_only: bool) -> List[dict]:
    shapes = {tuple(mb["tokens"].shape) for mb in micro_batches}
    if len(shapes) > 1:
        raise ValueError(f"the interleaved pipeline needs micro-batches of one shape, got {shapes}")
    pp = mpu.get_pipeline_model_parallel_world_size()
    missing = -len(micro_batches) % pp
    if missing and not forward_only:
        raise ValueError(f"the interleaved pipeline needs a multiple of PP={pp} micro-batches "
                         f"per step, got {len(micro_batches)}")
    return list(micro_batches) + [micro_batches[-1]] * missing


def zero_grads(chunks: Sequence[torch.nn.Module], optimizer) -> None:
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def optimizer_step(optimizer, scheduler) -> Tuple[bool, float]:
    """Clip, step and advance the schedule; returns (update applied, global grad norm).

    megatron-core's own `step()` checks for inf/NaN only under an fp16 loss scaler: with bf16 or
    fp32 a non-finite gradient would reach Adam and make every weight NaN. So the step runs its
    phases here and skips the update (weights, optimizer state and schedule untouched) when the
    global grad norm is not finite. The norm is reduced over every rank that holds gradients,
    so all ranks take the same decision."""
    if optimizer.prepare_grads():        # an fp16 loss-scale overflow: megatron's own skip
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm() or 0.0)
    if not math.isfinite(grad_norm):
        return False, grad_norm
    _clip(optimizer, grad_norm)
    ok = optimizer.step_with_ready_grads()
    if ok:
        scheduler.step(increment=1)
    return bool(ok), grad_norm


def _clip(optimizer, grad_norm: float) -> None:
    """Scale the gradients to --clip_grad by the global norm, in each of a chained optimizer's
    parts (megatron-core's clip_grad_by_total_norm_fp32, as its own step() does)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = part.get_parameters()
        if params and part.config.clip_grad > 0:
            clip_grad_by_total_norm_fp32(params, part.config.clip_grad, grad_norm,
                                         part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def gather_params(chunks: Sequence[torch.nn.Module]) -> None:
    """With --overlap_param_gather, finish the all-gather of the parameters the last optimizer
    step updated (megatron defers it to the next forward pass): for anything that reads the
    parameters outside a forward (weight sync, checkpoints, the reference model's mix-in)."""
    for chunk in chunks:
        if getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False):
            chunk.start_param_sync(force_sync=True)


def contribution_scale(num_micro_batches: int, dp_size: int) -> float:
    """Undo megatron's 1/num_micro_batches loss scaling and DDP's 1/dp gradient averaging."""
    return float(num_micro_batches * dp_size)
