"""Prompt order for GRPO: epochs, seeded shuffling, DP sharding and a resumable position.

The sampler walks one endless stream of prompt indices: epoch e is `permutation(seed + e)` of
0..num_prompts-1 (identity order without shuffling), epochs follow each other. Each rollout
batch takes the next `rollout_prompts` indices of the stream (all DP ranks together); DP rank r
of dp_size gets the contiguous slice [r * per_dp, (r + 1) * per_dp) of it, or, when the batch
is trained in several optimizer steps of `step_prompts` prompts each and every step's prompts
divide evenly over the DP ranks, rank r's part of EVERY step (step-interleaved). Then the
prompts of optimizer step k are the same whatever dp_size is, so a run reproduces across
data-parallel layouts.

An incomplete last batch of an epoch is NOT dropped: it continues into the next epoch's
permutation, so every prompt is used exactly once per epoch and none is skipped. Consequence: a
batch that straddles an epoch boundary (or any batch when the dataset holds fewer prompts than a
rollout batch) can hold the same prompt twice, so the trainer must key GRPO groups by the slot a
prompt occupies in the batch (or `batch_sample_ids`), not by the dataset's prompt_id.

`state_dict()` is the global stream position (identical on every rank), so a resumed run
continues the same order exactly, even with another dp_size.
"""
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from swift_megatron.errors import UserError


class PromptSampler:
    """Yields, per rollout batch, the prompt indices of THIS DP rank (an endless iterator).

    num_prompts: dataset size; rollout_prompts: prompts per rollout batch over all DP ranks
    (generation_batch_size / num_generations), divisible by dp_size; seed: the epoch-e order is
    seeded with seed + e; shuffle: False keeps the dataset order every epoch."""

    def __init__(self, num_prompts: int, rollout_prompts: int, dp_size: int = 1, dp_rank: int = 0,
                 seed: int = 0, shuffle: bool = True, step_prompts: Optional[float] = None):
        if num_prompts < 1:
            raise UserError("the training dataset has no prompts; check --dataset")
        if rollout_prompts < 1 or dp_size < 1 or rollout_prompts % dp_size:
            raise ValueError(f"rollout_prompts ({rollout_prompts}) must be a positive multiple of "
                             f"dp_size ({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.num_prompts, self.rollout_prompts = num_prompts, rollout_prompts
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.per_dp = rollout_prompts // dp_size
        self.seed, self.shuffle = seed, shuffle
        self.offsets = self._offsets(step_prompts)
        self.consumed = 0  # global stream position: prompts handed out on all ranks together
        self._order_epoch: Optional[int] = None
        self._order: Optional[np.ndarray] = None

    # -- position ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epoch of the next prompt to hand out."""
        return self.consumed // self.num_prompts

    @property
    def position(self) -> int:
        """Offset of the next prompt inside its epoch."""
        return self.consumed % self.num_prompts

    @property
    def steps_per_epoch(self) -> float:
        """Rollout batches per epoch (num_prompts / rollout_prompts; may be fractional)."""
        return self.num_prompts / self.rollout_prompts

    def state_dict(self) -> Dict[str, Any]:
        """Where the stream stands (same on every rank), plus what it was built with."""
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a `state_dict()`. UserError when the dataset size, seed or shuffling
        changed since, because the saved position would then mean other prompts."""
        for key in ("num_prompts", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(f"cannot resume the data order: the checkpoint was written with "
                                f"{key}={state[key]!r}, this run has {getattr(self, key)!r}; use the "
                                f"same --dataset/--seed/--dataset_shuffle to resume")
        self.consumed = int(state["epoch"]) * self.num_prompts + int(state["position"])

    # -- order ------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The prompt indices of `epoch` in the order they are used (cached for one epoch)."""
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.RandomState((self.seed + epoch) % 2**32)  # frozen stream (NEP 19)
                self._order = rng.permutation(self.num_prompts)
            else:
                self._order = np.arange(self.num_prompts)
            self._order_epoch = epoch
        return self._order

    def stream(self, start: int, count: int) -> List[int]:
        """`count` prompt indices from global stream position `start`, across epoch boundaries."""
        out: List[int] = []
        while len(out) < count:
            epoch, offset = divmod(start + len(out), self.num_prompts)
            take = min(count - len(out), self.num_prompts - offset)
            out.extend(self.epoch_order(epoch)[offset:offset + take].tolist())
        return out

    def _offsets(self, step_prompts: Optional[float]) -> List[int]:
        """This rank's positions inside a rollout batch (contiguous, or step-interleaved)."""
        per_step = step_prompts / self.dp_size if step_prompts else 0
        if per_step >= 1 and float(per_step).is_integer() and self.rollout_prompts % step_prompts == 0:
            per_step, step = int(per_step), int(step_prompts)
            return [k + self.dp_rank * per_step + i for k in range(0, self.rollout_prompts, step)
                    for i in range(per_step)]
        start = self.dp_rank * self.per_dp
        return list(range(start, start + self.per_dp))

    def batch_sample_ids(self) -> List[int]:
        """Stream positions of the batch `next()` will return on this rank: unique over the whole
        run, so usable as GRPO group ids where a prompt may repeat within a batch."""
        return [self.consumed + offset for offset in self.offsets]

    def __iter__(self) -> Iterator[List[int]]:
        return self

    def __next__(self) -> List[int]:
        batch = self.stream(self.consumed, self.rollout_prompts)
        self.consumed += self.rollout_prompts
        return [batch[offset] for offset in self.offsets]
