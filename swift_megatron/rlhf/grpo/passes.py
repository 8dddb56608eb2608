"""Between a rollout and its optimizer steps: the forward-only passes over the rollout batch's
micro-batches (megatron's pipelined schedule, results kept on the last pipeline stage) and the
advantages that depend on them.

- old_logprobs: the policy before any update. The first optimizer step's micro-batches need no
  pass (their forward in the step computes the same values, taken detached by the loss) unless
  they are trained again (--num_iterations > 1) or their KL enters the rewards (--kl_in_reward).
  With --router_replay_mode R2 this pass records the experts the policy's routers choose, which
  the micro-batch's training forwards then replay (model/routing_replay.py).
- ref_logprobs (--beta > 0) and teacher_logprobs (--teacher_model).
- --kl_in_reward: each completion's KL to the reference, computed on the last stage and sent to
  the other stages, so every rank of a replica holds it for the advantages.
- advantages: once assigned to the samples, copied into the micro-batches.
"""
from functools import partial
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from swift_megatron.model.routing_replay import RECORDED
from swift_megatron.rlhf.grpo.batch import Sample
from swift_megatron.rlhf.grpo.losses import sequence_kl
from swift_megatron.rlhf.grpo.objective import LossSettings, collect_logprobs
from swift_megatron.rlhf.grpo.references import Reference
from swift_megatron.rlhf.grpo.teacher import Teacher
from swift_megatron.training.step import forward_backward


@torch.no_grad()
def fill_logprobs(micro: List[dict], policy_chunks, reference: Reference,
                  teacher: Optional[Teacher], settings: LossSettings, *,
                  skip_old: int, beta: float, record_routes: bool = False) -> None:
    """old_logprobs for micro[skip_old:] (with `record_routes`, their routes recorded),
    ref_logprobs when beta > 0, teacher_logprobs with a teacher (each [B, S], on the last
    stage)."""
    collect = partial(collect_logprobs, settings)
    later = micro[skip_old:]
    for mb in later if record_routes else []:
        mb[RECORDED] = {}
    if later:
        for mb, out in zip(later, forward_backward(policy_chunks, later, collect, True)):
            mb["old_logprobs"] = out["logprobs"]
    if beta > 0:
        for mb, out in zip(micro, reference.logprobs(micro, collect)):
            mb["ref_logprobs"] = out["logprobs"]
    if teacher is not None:
        teacher.fill_logprobs(micro, settings)


def completion_kl(micro: List[dict], num_samples: int, state) -> torch.Tensor:
    """[num_samples] float64 on every rank: sequence_kl(old, ref) of each completion, in the
    micro-batches' order (computed on the last stage, broadcast over the pipeline group)."""
    values = torch.zeros(num_samples, dtype=torch.float64, device=state.device)
    if state.is_last_stage:
        values = torch.cat([sequence_kl(mb["old_logprobs"], mb["ref_logprobs"],
                                        mb["completion_mask"]) for mb in micro]).double()
    if state.pp > 1:
        dist.broadcast(values, src=state.last_stage_rank(), group=state.pp_group)
    return values.cpu()


def write_advantages(micro: List[dict], samples: Sequence[Sample]) -> None:
    """micro_batch["advantages"] [B] from the samples' advantages (micro-batches hold
    consecutive samples)."""
    start = 0
    for mb in micro:
        size = mb["completion_mask"].shape[0]
        mb["advantages"] = torch.tensor([s.advantage for s in samples[start:start + size]],
                                        dtype=torch.float32, device=mb["completion_mask"].device)
        start += size
