"""Completions -> micro-batches for Megatron (pure torch, no process groups).

A Sample is one completion with everything the loss needs. `collate` turns a list of samples
into one micro-batch: the model reads (prompt + completion)[:-1] and predicts `targets` =
(prompt + completion)[1:]; `completion_mask` marks the target positions that are completion
tokens the model generated (multi-turn: a sample's `loss_mask` leaves out the tool and
environment tokens between its turns). The loss-side tensors are [B, S] (B samples, S =
longest prompt + completion - 1).

What the model reads, two layouts:
- padded: `tokens` / `position_ids` [B, S'] right-padded (S' = S rounded up to
  `pad_to_multiple`); causal attention is exact for every real token;
- packed (`packed=True`, --padding_free): the B sequences back to back in one row, `tokens` /
  `position_ids` [1, T] (positions restart at 0 per sequence), `cu_seqlens` [N + 1] (int32,
  sequence boundaries for the attention and RoPE), `max_seqlen`, `packed_targets` [T] and
  `packed_index` [B, S]: where each (sample, position) sits in the packed row, -1 past a
  sample's length. T is rounded up to `pad_to_multiple` with one extra padding sequence.
  No padding token is computed; logprobs are gathered back into [B, S] (`unpack`). With
  `sequence_multiple` > 1 (context parallelism: 2 x CP) each sequence is padded at its end to
  a multiple of it, so that every sequence splits into 2 x CP equal chunks.
Images (a vision-language model): samples whose prompt holds images carry the processor's
`pixel_values` / `image_grid_thw` and the prompt's 3-D M-RoPE ids [3, P]; a micro-batch with any
of them gets `pixel_values` / `image_grid_thw` (concatenated in sample order, which is the
order of their image tokens in the rows), `image_keys` (a tuple: (group id, index in the
prompt) per image, which names it within a rollout batch: model/vision_cache.py), `prompt_mask`
(the prompt positions, in the layout of `tokens`: only there do image tokens take image
embeddings) and 3-D `position_ids` [3, B, S'] or [3, 1, T]
(completion tokens continue the prompt's last position on all three axes, as transformers'
generation does; text-only samples get the same id on the three axes).
`length` (the interleaved pipeline, whose stages exchange activations of one fixed shape): the
model's row length, [B, length] padded or [1, length] packed, at least what the samples need.
Routed experts (--router_replay_mode R3): samples that carry the engine's (`routed_experts`, one
row per position the engine ran: prompt + completion - 1, what the model reads, or one more,
dropped) give the micro-batch `routed_experts` in the layout of `tokens` plus two trailing
dims, [B, S', layers, top_k] or [1, T, layers, top_k] int16; padding positions get the
distinct experts 0 .. top_k - 1 (their outputs reach no loss). model/routing_replay.py replays
them.
"""
import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from swift_megatron.model.routing_replay import ROUTE_DTYPE, ROUTES


@dataclasses.dataclass
class Sample:
    group_id: int                     # unique per prompt within a rollout batch
    prompt_id: int                    # the prompt's index in the dataset (for logs)
    prompt_ids: List[int]
    completion_ids: List[int]
    rollout_logprobs: Optional[List[float]]
    finish_reason: str
    rewards: List[Optional[float]]    # one per reward function (None: not applicable)
    reward_raised: Optional[List[bool]] = None  # --reward_error_policy skip: per reward
    #                                         function, True where it raised (its reward: None)
    reward: float = 0.0               # weighted sum
    advantage: float = 0.0
    weight_version: int = 0
    completion_text: str = ""
    loss_mask: Optional[List[int]] = None   # multi-turn: 1 on the model's tokens, 0 on the
    #                                         scheduler's (tool/environment) tokens
    rollout_infos: Optional[Dict] = None    # multi-turn: the trajectory's metadata
    pixel_values: Optional[torch.Tensor] = None     # the prompt's images, as the engine saw them
    image_grid_thw: Optional[torch.Tensor] = None   # [images, 3]
    prompt_positions: Optional[torch.Tensor] = None  # [3, P] M-RoPE ids of the prompt
    routed_experts: Optional[Any] = None   # R3: the engine's experts [positions, layers, top_k]

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def collate(samples: Sequence[Sample], pad_id: int, pad_to_multiple: int = 1,
            overlong_filter: bool = False, packed: bool = False,
            sequence_multiple: int = 1, length: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """One micro-batch: targets/completion_mask [B, S], rollout_logprobs [B, S] (when every
    sample has the engine's logprobs), advantages/truncated/group_ids [B], and the model inputs
    of the chosen layout (module docstring). With overlong_filter, truncated completions get an
    empty mask."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    width = -(-max(lengths) // (1 if packed else pad_to_multiple)) * (1 if packed else pad_to_multiple)
    if length is not None and not packed:
        width = _at_least(width, length, pad_to_multiple)
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
        if sample.loss_mask is not None:
            mask[row, start:n] *= torch.tensor(sample.loss_mask, dtype=torch.float32)
        if sample.rollout_logprobs is not None:
            rollout[row, start:n] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    micro = dict(
        tokens=tokens, targets=targets, completion_mask=mask,
        position_ids=torch.arange(width).expand(batch, width).contiguous(),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long))
    if all(s.rollout_logprobs is not None for s in samples):
        micro["rollout_logprobs"] = rollout
    routes = route_rows(samples, lengths, width) if any(
        s.routed_experts is not None for s in samples) else None
    if packed:
        micro.update(pack(tokens, targets, lengths, pad_id, pad_to_multiple, sequence_multiple,
                          length))
        if routes is not None:
            routes = pack_routes(routes, lengths, micro["cu_seqlens"])
    if routes is not None:
        micro[ROUTES] = routes
    if any(s.pixel_values is not None for s in samples):
        micro.update(image_inputs(samples, micro))
    return micro


def route_rows(samples: Sequence[Sample], lengths: Sequence[int], width: int) -> torch.Tensor:
    """[B, width, layers, top_k] int16: each sample's routed experts at its first `lengths`
    positions, the filler elsewhere (module docstring)."""
    if any(s.routed_experts is None for s in samples):
        raise ValueError("routed experts for some samples of a micro-batch only")
    layers, top_k = samples[0].routed_experts.shape[1:]
    rows = filler_routes((len(samples), width, layers), top_k)
    for row, (sample, n) in enumerate(zip(samples, lengths)):
        rows[row, :n] = sample_routes(sample.routed_experts, n)
    return rows


def sample_routes(routes, count: int) -> torch.Tensor:
    """One sample's routed experts at the `count` positions the model reads (prompt +
    completion - 1); an engine's extra last row (the last token's) is dropped."""
    routes = torch.as_tensor(routes).to(ROUTE_DTYPE)
    if routes.shape[0] not in (count, count + 1):
        raise ValueError(f"the engine's routed experts cover {routes.shape[0]} positions of a "
                         f"sequence the trainer reads {count} positions of (prompt + completion "
                         "- 1): they do not belong to this completion")
    return routes[:count]


def filler_routes(shape, top_k: int) -> torch.Tensor:
    """Distinct experts 0 .. top_k - 1 at every position of `shape` (+ [top_k])."""
    return torch.arange(top_k, dtype=ROUTE_DTYPE).expand(*shape, top_k).clone()


def pack_routes(rows: torch.Tensor, lengths: Sequence[int], cu_seqlens: torch.Tensor
                ) -> torch.Tensor:
    """[B, S, layers, k] routes -> [1, T, layers, k] in the packed row of `cu_seqlens`."""
    packed = filler_routes((int(cu_seqlens[-1]), rows.shape[2]), rows.shape[3])
    for row, n in enumerate(lengths):
        packed[int(cu_seqlens[row]):int(cu_seqlens[row]) + n] = rows[row, :n]
    return packed.unsqueeze(0)


def image_inputs(samples: Sequence[Sample], micro: Dict[str, torch.Tensor]) -> dict:
    """pixel_values, image_grid_thw and 3-D position_ids of a micro-batch of `samples` whose
    (padded or packed) model inputs are `micro` (module docstring)."""
    with_images = [s for s in samples if s.pixel_values is not None]
    if "cu_seqlens" in micro:
        segments = (micro["cu_seqlens"][1:] - micro["cu_seqlens"][:-1]).tolist()
        positions = torch.cat([sample_positions(samples[r] if r < len(samples) else None, n)
                               for r, n in enumerate(segments)], dim=1).unsqueeze(1)
        prompt = torch.cat([sample_prompt_mask(samples[r] if r < len(samples) else None, n)
                            for r, n in enumerate(segments)]).unsqueeze(0)
    else:
        width = micro["tokens"].shape[1]
        positions = torch.stack([sample_positions(s, width) for s in samples], dim=1)
        prompt = torch.stack([sample_prompt_mask(s, width) for s in samples])
    return dict(pixel_values=torch.cat([s.pixel_values for s in with_images]),
                image_grid_thw=torch.cat([s.image_grid_thw for s in with_images]),
                image_keys=tuple((s.group_id, j) for s in with_images
                                 for j in range(len(s.image_grid_thw))),
                position_ids=positions, prompt_mask=prompt)


def sample_prompt_mask(sample: Optional[Sample], count: int) -> torch.Tensor:
    """[count] bool: which of a sample's first `count` positions are its prompt's (a completion
    may sample the image token id: only the prompt's image tokens take image embeddings)."""
    length = 0 if sample is None else len(sample.prompt_ids)
    return torch.arange(count) < length


def sample_positions(sample: Optional[Sample], count: int) -> torch.Tensor:
    """[3, count] M-RoPE ids of the first `count` positions of a sample's tokens: its prompt's,
    then one more per position on all three axes (None or a text-only sample: 0, 1, ...)."""
    if sample is None or sample.prompt_positions is None:
        return torch.arange(count).expand(3, count)
    prompt = sample.prompt_positions.long()
    if count <= prompt.shape[1]:
        return prompt[:, :count]
    return torch.cat([prompt, prompt[:, -1:] + torch.arange(1, count - prompt.shape[1] + 1)], dim=1)


def _at_least(needed: int, length: int, multiple: int) -> int:
    if length < needed or length % multiple:
        raise ValueError(f"length={length} is shorter than the {needed} positions needed or not "
                         f"a multiple of {multiple}")
    return length


def pack(tokens: torch.Tensor, targets: torch.Tensor, lengths: Sequence[int], pad_id: int,
         pad_to_multiple: int = 1, sequence_multiple: int = 1,
         length: Optional[int] = None) -> dict:
    """The packed model inputs of right-padded `tokens` / `targets` [B, S] whose rows hold
    `lengths` real positions (module docstring). `pad_to_multiple` must be a multiple of
    `sequence_multiple`."""
    if pad_to_multiple % sequence_multiple:
        raise ValueError(f"pad_to_multiple={pad_to_multiple} is not a multiple of "
                         f"sequence_multiple={sequence_multiple}")
    segments = [-(-n // sequence_multiple) * sequence_multiple for n in lengths]
    total = sum(segments)
    padded_total = -(-total // pad_to_multiple) * pad_to_multiple
    if length is not None:
        padded_total = _at_least(padded_total, length, pad_to_multiple)
    segments += [padded_total - total] if padded_total > total else []
    cu_seqlens = torch.tensor([0] + segments, dtype=torch.int64).cumsum(0).to(torch.int32)

    def padded_rows(rows: torch.Tensor) -> torch.Tensor:
        row = torch.full((padded_total,), pad_id, dtype=torch.long)
        for r, n in enumerate(lengths):
            row[cu_seqlens[r]:cu_seqlens[r] + n] = rows[r, :n]
        return row

    index = torch.full(tokens.shape, -1, dtype=torch.long)
    for r, n in enumerate(lengths):
        index[r, :n] = torch.arange(cu_seqlens[r], cu_seqlens[r] + n)
    return dict(
        tokens=padded_rows(tokens).unsqueeze(0),
        position_ids=torch.cat([torch.arange(n) for n in segments]).unsqueeze(0),
        packed_targets=padded_rows(targets), packed_index=index, cu_seqlens=cu_seqlens,
        max_seqlen=max(segments))


def unpack(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Values per packed position [T] -> [B, S] by `packed_index` (0 past a sample's end)."""
    return torch.where(index >= 0, packed[index.clamp(min=0)], packed.new_zeros(()))


def split_micro_batches(samples: Sequence[Sample], micro_batch_size: int,
                        max_tokens: Optional[int] = None, **collate_kwargs
                        ) -> List[Dict[str, torch.Tensor]]:
    """Consecutive groups of micro_batch_size samples, each collated; with `max_tokens`, groups of
    as many consecutive samples as fit that many tokens (prompt + completion; at least one)."""
    if max_tokens is not None:
        return [collate(group, **collate_kwargs) for group in token_groups(samples, max_tokens)]
    if len(samples) % micro_batch_size:
        raise ValueError(f"{len(samples)} samples do not split into micro-batches of "
                         f"{micro_batch_size}")
    return [collate(samples[i:i + micro_batch_size], **collate_kwargs)
            for i in range(0, len(samples), micro_batch_size)]


def token_groups(samples: Sequence[Sample], max_tokens: int) -> List[List[Sample]]:
    """Consecutive samples whose tokens (prompt + completion - 1, what the model reads) add up
    to at most max_tokens; a longer sample forms a group of its own."""
    groups: List[List[Sample]] = []
    total = 0
    for sample in samples:
        length = len(sample.prompt_ids) + len(sample.completion_ids) - 1
        if groups and total + length <= max_tokens:
            groups[-1].append(sample)
            total += length
        else:
            groups.append([sample])
            total = length
    return groups


def fixed_length(samples: Sequence[Sample], micro_batch_size: int, packed: bool,
                 pad_to_multiple: int = 1, sequence_multiple: int = 1) -> int:
    """A row length that fits every micro-batch of micro_batch_size of these samples (for
    `collate`'s `length`): the longest sample, times micro_batch_size when packed."""
    longest = max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    if packed:
        longest = -(-longest // sequence_multiple) * sequence_multiple * micro_batch_size
    return -(-longest // pad_to_multiple) * pad_to_multiple


def to_device(micro_batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    """Tensors to `device`; other values (max_seqlen) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in micro_batch.items()}
