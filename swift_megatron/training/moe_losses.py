"""The MoE routers' auxiliary losses of one optimizer step, as `moe/` metrics.

megatron-core's routers add their load-balancing and z-losses to the gradient themselves
(`MoEAuxLossAutoScaler`, scaled like the main loss: 1 / micro-batches per micro-batch, DDP's
average over data-parallel ranks) and record each layer's loss before its coefficient in
megatron's layer-wise tracker. `moe_loss_metrics` reads that tracker after a training pass:
summed over the pipeline stages and the routers' reduce groups (megatron's
`reduce_aux_losses_tracker_across_ranks`), it logs the mean over the layers and micro-batches,
as Megatron-LM and ms-swift log them (`moe/load_balancing_loss`, `moe/seq_load_balancing_loss`,
`moe/global_load_balancing_loss`, `moe/z_loss`), and clears the tracker for the next step.
Forward-only passes add nothing (the routers compute their losses in training mode only).
"""
from typing import Dict, List

import torch
from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                     get_moe_layer_wise_logging_tracker,
                                                     reduce_aux_losses_tracker_across_ranks)

# megatron's tracker name of each load-balancing type's loss
TRACKER_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}


def tracked_losses(config) -> List[str]:
    """The tracker names of the losses a TransformerConfig's routers compute: each aux-loss
    type with a positive coefficient, and the z-loss when it has a coefficient. Pure."""
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    types = [types] if isinstance(types, str) else list(types)
    coeffs = [coeffs] * len(types) if not isinstance(coeffs, (list, tuple)) else list(coeffs)
    names = [TRACKER_NAMES[kind] for kind, coeff in zip(types, coeffs)
             if kind in TRACKER_NAMES and coeff > 0]
    return names + (["z_loss"] if config.moe_z_loss_coeff is not None else [])


def moe_loss_metrics(config, num_micro_batches: int, device: torch.device) -> Dict[str, float]:
    """The step's `moe/<loss>` metrics (module docstring); {} for a dense model or without
    losses. Collective over the pipeline and the routers' groups: every rank calls it after the
    step's training pass."""
    names = tracked_losses(config) if config.num_moe_experts else []
    if not names:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    for name in names:   # a stage whose routers recorded nothing still joins the reductions
        tracker.setdefault(name, dict(values=torch.zeros(config.num_layers, device=device),
                                      reduce_group=None, avg_group=None,
                                      reduce_group_has_dp=False))
    reduce_aux_losses_tracker_across_ranks(names)
    scale = 1.0 / (config.num_layers * max(num_micro_batches, 1))
    metrics = {f"moe/{name}": float(tracker[name]["values"].sum()) * scale for name in names}
    clear_aux_losses_tracker()
    return metrics
