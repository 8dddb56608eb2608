"""Routing replay (--router_replay_mode R2 / R3): the policy's MoE routers take given experts
instead of their own top-k, through megatron-core's RouterReplay (one per router of a model
built with `moe_enable_routing_replay`, `replay_settings`): the router's softmax still runs on
its own logits, gathered at the given experts, so gradients reach the router as usual.

A micro-batch (rlhf/grpo/batch.py) says what its forwards do, per model chunk:
- `ROUTES` (R3): a [b, s, layers, top_k] tensor in the layout of its `tokens` ([1, T, ...]
  packed): the experts the rollout engine chose for every prompt and completion token, per
  layer of the whole model; each chunk replays its own layers' columns;
- `RECORDED` (R2): a dict {layer index: [router tokens, top_k]} in each router's own token
  layout (this rank's context-parallel share, its sequence-parallel slice). A chunk whose
  layers are all in it replays them; otherwise its forward records them into it (the
  old-policy pass, rlhf/grpo/passes.py, gives the micro-batch an empty dict);
- neither: the routers route themselves.

Recomputation: a replaying forward appends each target to the router's queue, and the action
switches to REPLAY_BACKWARD once the forward returns, so an activation recomputation in the
backward pass (--recompute_granularity) pops the targets in the forwards' order (1F1B and the
interleaved schedule run the backwards of a chunk in the order of its forwards); `end_pass`
empties the queues and clears the actions after every pass.

The router's token order: the chunk's input [s, b] flattened s-major (what the embedding hands
the decoder), this CP rank's positions (parallel/context.py), then, with sequence parallelism,
this TP rank's contiguous slice of them.
"""
import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.router_replay import RouterReplayAction

ROUTES = "routed_experts"
RECORDED = "recorded_routes"
ROUTE_DTYPE = torch.int16    # expert indices as they travel and wait (up to 32767 experts)
_CACHE = "_swift_megatron_replay_routers"


def replay_settings(enabled: bool) -> dict:
    """TransformerConfig settings of a model whose routers can replay."""
    return {"moe_enable_routing_replay": True} if enabled else {}


def replay_routers(chunk: torch.nn.Module) -> List[Tuple[int, object]]:
    """(0-based layer index, RouterReplay) of every replaying router of a model chunk (its
    layers' global numbers), in layer order; [] for a model built without replay."""
    found = getattr(chunk, _CACHE, None)
    if found is None:
        found = sorted((m.layer_number - 1, m.router_replay) for m in chunk.modules()
                       if getattr(m, "router_replay", None) is not None)
        setattr(chunk, _CACHE, found)
    return found


def local_routes(routes: torch.Tensor, share, sequence_parallel: bool) -> torch.Tensor:
    """[b, s, layers, k] routes in the model input's layout -> [router tokens, layers, k] in the
    router's token order (module docstring)."""
    if share is not None:
        routes = share.local(routes, 1)
    routes = routes.transpose(0, 1)
    if sequence_parallel and mpu.get_tensor_model_parallel_world_size() > 1:
        size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        routes = routes.chunk(size, dim=0)[rank]
    return routes.reshape(-1, *routes.shape[2:])


@contextlib.contextmanager
def replaying(chunk: torch.nn.Module, micro_batch: dict, share, sequence_parallel: bool):
    """Around one forward of `chunk` on `micro_batch`: replay or record (module docstring)."""
    routers = replay_routers(chunk)
    targets = _targets(routers, micro_batch, share, sequence_parallel) if routers else None
    if targets is not None:
        for (_, router), target in zip(routers, targets):
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.set_target_indices(target)
        yield
        for _, router in routers:
            router.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    elif routers and RECORDED in micro_batch:
        for _, router in routers:
            router.set_router_replay_action(RouterReplayAction.RECORD)
        yield
        for layer, router in routers:
            micro_batch[RECORDED][layer] = router.get_recorded_indices().to(ROUTE_DTYPE)
            router.clear_router_replay_action()
    else:
        yield


def _targets(routers, micro_batch: dict, share,
             sequence_parallel: bool) -> Optional[List[torch.Tensor]]:
    """Each router's experts for this forward (int64), or None when the micro-batch has none
    for this chunk."""
    recorded: Optional[Dict[int, torch.Tensor]] = micro_batch.get(RECORDED)
    if recorded is not None and all(layer in recorded for layer, _ in routers):
        return [recorded[layer].long() for layer, _ in routers]
    routes = micro_batch.get(ROUTES)
    if routes is None:
        return None
    if routes.shape[:2] != micro_batch["tokens"].shape[:2]:
        raise ValueError(f"routes of shape {tuple(routes.shape)} for tokens of shape "
                         f"{tuple(micro_batch['tokens'].shape)}")
    local = local_routes(routes, share, sequence_parallel)
    return [local[:, layer].long() for layer, _ in routers]


def without_routes(micro_batch: dict) -> dict:
    """The micro-batch without its routes (a shallow copy): the routers of a forward of it
    route themselves (the LoRA policy's reference pass, as ms-swift's)."""
    return {k: v for k, v in micro_batch.items() if k not in (ROUTES, RECORDED)}


def end_pass(chunks) -> None:
    """After a pass over micro-batches: every router's queued targets dropped, actions
    cleared."""
    for chunk in chunks:
        for _, router in replay_routers(chunk):
            router.clear_indices()
            router.clear_router_replay_action()
