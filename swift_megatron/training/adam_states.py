"""Adam with its moments kept in a lower precision (--exp_avg_dtype / --exp_avg_sq_dtype bf16
with --use_precision_aware_optimizer): the memory of Transformer Engine's precision-aware
FusedAdam without Transformer Engine.

megatron-core 0.16.1 asks Transformer Engine's FusedAdam for these dtypes (torch's AdamW takes
no such argument). Here megatron builds its usual optimizer (float32 main parameters in the
distributed optimizer, torch's AdamW over them) and `keep_states_in` turns each inner AdamW into
`LowPrecisionAdamW`: the same update, computed in float32 one parameter at a time, whose moments
are stored rounded to their dtypes. bf16 moments halve the moments' memory (8 -> 4 bytes per
trained parameter); the update differs from float32 Adam by the rounding of the moments
(tests/unit/test_adam_states.py measures it).
"""
import math
from typing import Dict, Tuple

import torch

DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: int, group: dict) -> None:
    """torch's AdamW update (no amsgrad) of `param` in place, with float32 moments updated in
    place; `step` counts this update (1 for the first)."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    param.mul_(1 - lr * group["weight_decay"])
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
    param.addcdiv_(exp_avg, denom, value=-step_size)


class LowPrecisionAdamW(torch.optim.AdamW):
    """torch's AdamW with `exp_avg` / `exp_avg_sq` stored in `state_dtypes` (set by
    `keep_states_in`). State that arrives in float32 (a fresh state, a loaded checkpoint) is
    rounded at the next step; `step` stays a float32 host tensor, as torch keeps it."""

    state_dtypes: Tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtypes[0])
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtypes[1])
        state["step"] = state["step"].cpu() + 1
        moments = [state[k].float() for k in ("exp_avg", "exp_avg_sq")]
        adamw_update(param, param.grad.float(), *moments, int(state["step"]), group)
        for key, value, dtype in zip(("exp_avg", "exp_avg_sq"), moments, self.state_dtypes):
            state[key] = value.to(dtype)


def keep_states_in(inner_optimizers, exp_avg_dtype: str, exp_avg_sq_dtype: str) -> None:
    """Make each torch AdamW of `inner_optimizers` (those inside a megatron optimizer) a
    LowPrecisionAdamW with these moment dtypes ("fp32" or "bf16"); its param groups, state and
    hyperparameters stay."""
    dtypes = (DTYPES[exp_avg_dtype], DTYPES[exp_avg_sq_dtype])
    for inner in inner_optimizers:
        if not isinstance(inner, torch.optim.AdamW):
            raise TypeError(f"expected torch's AdamW inside the optimizer, got {type(inner)}")
        inner.__class__ = LowPrecisionAdamW
        inner.state_dtypes = dtypes
