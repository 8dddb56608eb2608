"""One optimizer step's loss metrics from the per micro-batch values of the last pipeline stage:
`loss` summed over micro-batches and data-parallel ranks (it is each micro-batch's share of the
step loss), keys ending in `_max` / `_min` reduced by max / min, every other key averaged; then
sent to the first stage, where global rank 0 logs.
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from swift_megatron.logging import reduce_metrics
from swift_megatron.logging.metrics import to_scalar


def _extreme(outputs: List[dict], key: str, pick) -> float:
    return pick(float(to_scalar(out[key], key)) for out in outputs if key in out)


def reduce_local(outputs: List[dict]) -> Dict[str, float]:
    """This rank's micro-batches: loss summed, _max / _min extremes, the rest averaged."""
    local = reduce_metrics(outputs)
    local["loss"] *= len(outputs)
    for key in local:
        if key.endswith("_max"):
            local[key] = _extreme(outputs, key, max)
        elif key.endswith("_min"):
            local[key] = _extreme(outputs, key, min)
    return local


def _all_reduce(values: Dict[str, float], keys: List[str], op, device, group) -> Dict[str, float]:
    if not keys:
        return {}
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return dict(zip(keys, tensor.tolist()))


def step_metrics(outputs: List[dict], state) -> Dict[str, float]:
    """The step's metrics on every rank (`loss` logged as loss/policy)."""
    metrics: List[Optional[Dict[str, float]]] = [None]
    if state.is_last_stage:
        local = reduce_local(outputs)
        maxima = sorted(k for k in local if k.endswith("_max"))
        minima = sorted(k for k in local if k.endswith("_min"))
        summed = sorted(k for k in local if k not in maxima and k not in minima)
        reduced = _all_reduce(local, summed, dist.ReduceOp.SUM, state.device, state.dp_group)
        reduced = {k: v / (1 if k == "loss" else state.dp) for k, v in reduced.items()}
        reduced.update(_all_reduce(local, maxima, dist.ReduceOp.MAX, state.device, state.dp_group))
        reduced.update(_all_reduce(local, minima, dist.ReduceOp.MIN, state.device, state.dp_group))
        metrics = [{"loss/policy" if k == "loss" else k: v for k, v in reduced.items()}]
    if state.pp > 1:
        dist.broadcast_object_list(metrics, src=state.last_stage_rank(), group=state.pp_group)
    return metrics[0]
