"""--tail_logprobs: the forward-only passes of a rollout batch run in the generation's tail.

While the colocated vLLM engine decodes the last, longest completions of a rollout batch, the
completions already finished get their reference and old-policy logprobs, so that when the last
one ends only its own passes remain (docs/rlhf.md, "Logprob passes in the generation's tail").

How: the colocate engine reports, between two engine steps, the requests that finished in the
step (rollout/vllm_colocate.py `on_finished`). Each finished completion becomes a sample queued
for the passes it needs: the reference's (--beta > 0) and the old policy's where the trainer's
passes would give it one (not the first optimizer step's completions, unless --num_iterations >
1 or --kl_in_reward). Once a queue holds a micro-batch's worth (--micro_batch_size
samples, or --max_tokens_per_micro_batch tokens), one forward-only pass runs over it (at most
one per engine step, so decoding goes on between passes); on CUDA the passes run on a stream of
their own, next to the engine's kernels. After the generation `fill` runs the passes the
samples still lack (the last completions, those of dynamic-sampling rounds), in micro-batches of
their own, and writes every sample's values into the optimizer steps' micro-batches.

The values are the ones the synchronous passes give: the same model, forward-only in eval mode,
on the same tokens, only grouped into other micro-batches (float rounding may differ); each is
keyed by the sample's group id, prompt and completion tokens, so a group replaced by a
dynamic-sampling round never takes another group's values. Positions past a sample's own are 0
in the micro-batch (the completion mask leaves them out of the loss).

It needs the models resident while the engine generates and every pass local to this process
(one process per model replica: TP, PP, CP and EP 1): arguments/commands.py
(`tail_logprobs_problem`) and `tail_kinds` say when it applies.
"""
import contextlib
import time
from functools import partial
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo.batch import Sample, token_groups
from swift_megatron.rlhf.grpo.objective import collect_logprobs
from swift_megatron.rollout.engine import Completion
from swift_megatron.training.step import forward_backward

OLD, REF = "old_logprobs", "ref_logprobs"
Key = Tuple[int, Tuple[int, ...], Tuple[int, ...]]
PassFn = Callable[[List[dict]], List[torch.Tensor]]   # micro-batches -> logprobs [B, S] each
Collate = Callable[[List[Sample]], dict]              # samples -> one micro-batch on the device


def sample_key(sample: Sample) -> Key:
    return sample.group_id, tuple(sample.prompt_ids), tuple(sample.completion_ids)


def positions(sample: Sample) -> int:
    """The positions the model reads for a sample (prompt + completion - 1)."""
    return len(sample.prompt_ids) + len(sample.completion_ids) - 1


def full_group(queue: Sequence[Sample], micro_batch_size: int,
               max_tokens: Optional[int]) -> Optional[List[Sample]]:
    """The queue's first micro-batch once it holds a full one (micro_batch_size samples, or at
    least max_tokens tokens), else None. Pure."""
    if max_tokens is None:
        return list(queue[:micro_batch_size]) if len(queue) >= micro_batch_size else None
    if sum(positions(s) for s in queue) < max_tokens:
        return None
    return token_groups(queue, max_tokens)[0]


def groups(samples: Sequence[Sample], micro_batch_size: int,
           max_tokens: Optional[int]) -> List[List[Sample]]:
    """All of `samples` in micro-batches (by tokens with max_tokens; the last may be short).
    Pure."""
    if max_tokens is not None:
        return token_groups(samples, max_tokens)
    return [list(samples[i:i + micro_batch_size])
            for i in range(0, len(samples), micro_batch_size)]


def assemble(samples: Sequence[Sample], values: Dict[Key, torch.Tensor],
             like: torch.Tensor) -> torch.Tensor:
    """[B, S] as `like` (a micro-batch's completion_mask) holding each sample's stored values
    over its positions, 0 past them. Pure."""
    out = torch.zeros_like(like)
    for row, sample in enumerate(samples):
        value = values[sample_key(sample)]
        out[row, :value.numel()] = value
    return out


_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def side_stream() -> Optional["torch.cuda.Stream"]:
    """The CUDA stream of this device's tail passes (None without CUDA): one for the whole run,
    since the memory the passes free stays cached for their stream alone and is reused by the
    next rollout batch's passes (about one pass's working set stays reserved beside training)."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream()
    return _STREAMS[device]


class TailPasses:
    """One rollout batch's passes (module docstring). `passes`: kind (OLD, REF) -> the pass;
    `hold`: kind -> a context kept open from that kind's first pass until `close` (an offloaded
    reference stays on the device, `Reference.resident`)."""

    def __init__(self, passes: Dict[str, PassFn], collate: Collate, micro_batch_size: int,
                 max_tokens: Optional[int] = None,
                 hold: Optional[Dict[str, Callable[[], ContextManager]]] = None):
        self.passes, self.collate = passes, collate
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self.hold, self._held = hold or {}, contextlib.ExitStack()
        self.values: Dict[str, Dict[Key, torch.Tensor]] = {kind: {} for kind in passes}
        self.queues: Dict[str, List[Sample]] = {kind: [] for kind in passes}
        self.requests: List[Tuple[Sample, Tuple[str, ...]]] = []
        self._held_kinds: set = set()
        self.stream = side_stream()
        self.tail_passes, self.tail_seconds, self.expected = 0, 0.0, 0

    def expect(self, requests: Sequence[Tuple[Sample, Sequence[str]]]) -> None:
        """The generate call's requests in order: a sample holding the request's group id,
        prompt id and prompt tokens, and the passes its completion needs."""
        self.requests = [(sample, tuple(k for k in kinds if k in self.passes))
                         for sample, kinds in requests]
        self.expected = sum(len(kinds) for _, kinds in self.requests)

    def on_finished(self, finished: List[Tuple[int, Completion]]) -> None:
        """The engine's report after a step: queue what finished, run one full micro-batch."""
        for index, completion in finished:
            request, kinds = self.requests[index]
            sample = Sample(group_id=request.group_id, prompt_id=request.prompt_id,
                            prompt_ids=request.prompt_ids, completion_ids=completion.token_ids,
                            rollout_logprobs=None, finish_reason=completion.finish_reason,
                            rewards=[])
            for kind in kinds:
                self.queues[kind].append(sample)
        for kind, queue in self.queues.items():
            group = full_group(queue, self.micro_batch_size, self.max_tokens)
            if group:
                del queue[:len(group)]
                start = time.perf_counter()
                self._run(kind, [group])
                self.tail_seconds += time.perf_counter() - start
                self.tail_passes += 1
                return

    @torch.no_grad()
    def _run(self, kind: str, micro_groups: List[List[Sample]]) -> None:
        """The `kind` pass over micro-batches of these samples; their values stored."""
        if kind in self.hold and kind not in self._held_kinds:
            self._held.enter_context(self.hold[kind]())
            self._held_kinds.add(kind)
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            micro = [self.collate(group) for group in micro_groups]
            for group, out in zip(micro_groups, self.passes[kind](micro)):
                for row, sample in enumerate(group):
                    self.values[kind][sample_key(sample)] = out[row, :positions(sample)].clone()

    def fill(self, micro: List[dict], samples: Sequence[Sample], skip_old: int) -> None:
        """After the generation: the passes the samples still lack, then every micro-batch's
        `ref_logprobs` and, from micro[skip_old] on, `old_logprobs` (as passes.fill_logprobs
        writes them). `micro` holds `samples` in order, consecutively."""
        rows, start = [], 0
        for mb in micro:
            rows.append(samples[start:start + mb["completion_mask"].shape[0]])
            start += len(rows[-1])
        wanted = {REF: list(samples), OLD: [s for group in rows[skip_old:] for s in group]}
        for kind in self.passes:
            missing = [s for s in wanted[kind] if sample_key(s) not in self.values[kind]]
            if missing:
                self._run(kind, groups(missing, self.micro_batch_size, self.max_tokens))
        if self.stream is not None:
            self._join_stream()
        for index, (mb, group) in enumerate(zip(micro, rows)):
            for kind in self.passes:
                if kind == REF or index >= skip_old:
                    mb[kind] = assemble(group, self.values[kind], mb["completion_mask"])

    def _join_stream(self) -> None:
        """The default stream waits for the passes' stream, and the values are marked as used
        there (the allocator keeps them until its work is done)."""
        current = torch.cuda.current_stream()
        current.wait_stream(self.stream)
        for values in self.values.values():
            for value in values.values():
                value.record_stream(current)

    def generation_done(self) -> Dict[str, float]:
        """At the end of the generation, its metrics: rollout/tail_passes, the passes run during
        it; time/tail_logprobs_s, the host time they took there; rollout/tail_logprobs_fraction,
        the share of the requests' per-sample values (one per pass a request needs) computed
        then."""
        during = sum(len(v) for v in self.values.values())
        return {"rollout/tail_passes": float(self.tail_passes),
                "time/tail_logprobs_s": self.tail_seconds,
                "rollout/tail_logprobs_fraction": during / max(self.expected, 1)}

    def close(self) -> None:
        """Release what `hold` kept (an offloaded reference goes back to host memory)."""
        self._held.close()


# ---- when it runs, and the passes of a run ----------------------------------------------------
def tail_kinds(args, steps_per_generation: int, colocate: bool, images: bool) -> Tuple[str, ...]:
    """The passes --tail_logprobs runs in this run (rlhf arguments, the batch plan's
    steps_per_generation, whether the engine is the colocated vLLM one and the prompts hold
    images); () when it is off. UserError where `true` was asked of a run it cannot serve."""
    if not args.rollout.tail_logprobs:
        return ()
    g = args.grpo
    problem = args.tail_logprobs_problem() or _run_problem(colocate, images)
    if problem:
        raise UserError(f"--tail_logprobs true cannot run here: {problem}; drop --tail_logprobs")
    old = steps_per_generation > 1 or g.num_iterations > 1 or (g.kl_in_reward and g.beta > 0)
    ref = g.beta > 0
    return (OLD,) * old + (REF,) * ref


def _run_problem(colocate: bool, images: bool) -> Optional[str]:
    if not colocate:
        return "it needs the colocated vLLM engine (vLLM is not used: --use_vllm)"
    if images:
        return "prompts with images are not supported (the vision tower's cache spans the batch)"
    return None


def build(kinds: Sequence[str], policy_chunks, reference, settings, collate: Collate,
          micro_batch_size: int, max_tokens: Optional[int]) -> TailPasses:
    """The TailPasses of one rollout batch: the old policy's pass through `policy_chunks`, the
    reference's through `reference` (references.Reference, kept resident from its first pass
    when offloaded), both with passes.py's logprob callback."""
    collect = partial(collect_logprobs, settings)
    passes: Dict[str, PassFn] = {}
    if OLD in kinds:
        passes[OLD] = lambda micro: [out["logprobs"] for out in
                                     forward_backward(policy_chunks, micro, collect, True)]
    if REF in kinds:
        passes[REF] = lambda micro: [out["logprobs"] for out in reference.logprobs(micro, collect)]
    hold = {REF: lambda: reference.resident(read_only=True)} if REF in kinds else {}
    return TailPasses(passes, collate, micro_batch_size, max_tokens, hold)
