"""The non-finite guard (docs/rlhf.md, "Non-finite guard"): training/step.py skips an update
whose global gradient norm is NaN or inf; `SkipGuard` counts those skips and stops the run after
--max_skipped_steps in a row; `check_finite_weights` keeps non-finite weights out of every
checkpoint (and so out of `latest`, final_hf and exports, which are made from checkpoints)."""
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from swift_megatron.errors import NonFiniteError

ADVICE = "lower --lr (or --clip_grad), or check the scale of the reward functions"


class SkipGuard:
    """Consecutive skipped updates; `limit` 0 never stops the run."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def update(self, applied: bool, grad_norm: float, step: int) -> Optional[str]:
        """None after an applied update; a warning line after a skipped one; NonFiniteError when
        the skip makes `limit` in a row."""
        if applied:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"step {step}: the gradient norm was {grad_norm} for {self.in_a_row} optimizer "
                f"steps in a row (--max_skipped_steps {self.limit}): training stopped, nothing "
                f"non-finite was applied or saved; {ADVICE}")
        return (f"step {step}: gradient norm {grad_norm}: update skipped ({self.in_a_row} in a "
                f"row; --max_skipped_steps {self.limit})")


@torch.no_grad()
def check_finite_weights(chunks: Sequence[torch.nn.Module], what: str) -> None:
    """NonFiniteError on every rank when any rank's weights hold a NaN or inf. Collective."""
    flags = [torch.isfinite(p).all() for chunk in chunks for p in chunk.parameters()]
    device = flags[0].device if flags else torch.device("cpu")
    finite = torch.stack(flags).all().to(torch.int32) if flags else \
        torch.ones((), dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise NonFiniteError(f"{what}: the model's weights hold NaN or inf: not saved; {ADVICE}")
