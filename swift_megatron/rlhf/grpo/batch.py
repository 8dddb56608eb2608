"""Completions -> padded micro-batches for Megatron (pure torch, no process groups).

A Sample is one completion with everything the loss needs. `collate` turns a list of samples
into one micro-batch: the model reads `tokens` = (prompt + completion)[:-1], right-padded, and
predicts `targets` = (prompt + completion)[1:]; `completion_mask` marks the target positions
that are completion tokens. Right padding keeps causal attention exact for every real token.
Shapes: B samples, S = longest prompt + completion - 1 (rounded up to `pad_to_multiple`).
"""
import dataclasses
from typing import Dict, List, Optional, Sequence

import torch


@dataclasses.dataclass
class Sample:
    group_id: int                     # unique per prompt within a rollout batch
    prompt_id: int                    # the prompt's index in the dataset (for logs)
    prompt_ids: List[int]
    completion_ids: List[int]
    rollout_logprobs: Optional[List[float]]
    finish_reason: str
    rewards: List[Optional[float]]    # one per reward function (None: not applicable)
    reward: float = 0.0               # weighted sum
    advantage: float = 0.0
    weight_version: int = 0
    completion_text: str = ""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def collate(samples: Sequence[Sample], pad_id: int, pad_to_multiple: int = 1,
            overlong_filter: bool = False) -> Dict[str, torch.Tensor]:
    """One micro-batch: tokens/position_ids/targets/completion_mask/rollout_logprobs [B, S],
    advantages/truncated [B]. With overlong_filter, truncated completions get an empty mask."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    width = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    batch = len(samples)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    targets = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.float32)
    rollout = torch.zeros((batch, width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        sequence = torch.tensor(sample.prompt_ids + sample.completion_ids, dtype=torch.long)
        n, start = lengths[row], len(sample.prompt_ids) - 1
        tokens[row, :n], targets[row, :n] = sequence[:-1], sequence[1:]
        keep = not (overlong_filter and sample.truncated)
        mask[row, start:n] = float(keep)
        if sample.rollout_logprobs is not None:
            rollout[row, start:n] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    return dict(
        tokens=tokens, targets=targets, completion_mask=mask, rollout_logprobs=rollout,
        position_ids=torch.arange(width).expand(batch, width).contiguous(),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool))


def split_micro_batches(samples: Sequence[Sample], micro_batch_size: int, **collate_kwargs
                        ) -> List[Dict[str, torch.Tensor]]:
    """Consecutive groups of micro_batch_size samples, each collated."""
    if len(samples) % micro_batch_size:
        raise ValueError(f"{len(samples)} samples do not split into micro-batches of "
                         f"{micro_batch_size}")
    return [collate(samples[i:i + micro_batch_size], **collate_kwargs)
            for i in range(0, len(samples), micro_batch_size)]


def to_device(micro_batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in micro_batch.items()}
