"""Which metric goes in which figure: one table of groups -> key patterns, matched against the
keys a run actually logged (fnmatch patterns; `*` also matches `/`).

The keys come from the trainer (rlhf/grpo/trainer.py: loss/policy, grad_norm, lr,
update_skipped, time/*, perf/*, memory/*, sync/*, eval/*), the objective (rlhf/grpo/objective.py: kl,
entropy, clip_ratio/*, rollout/logprob_abs_diff_mean, rollout/kl_trainer_vs_engine,
rollout/is_weight_mean) and the collector (rlhf/grpo/collect.py: reward/*, rollout/*).
A key no group names lands in "other", so a new metric is plotted before this table knows it.
Each group becomes report/<name>.png with one panel per key; "overview" repeats the main curves
in one figure and is left out of summary.md's tables.
"""
import fnmatch
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Group:
    name: str                    # file name stem: report/<name>.png
    title: str
    patterns: Tuple[str, ...]
    in_summary: bool = True


GROUPS = (
    Group("overview", "Overview", ("reward/mean", "kl", "loss/policy", "grad_norm", "entropy",
                                   "rollout/completion_length_mean"), in_summary=False),
    Group("reward", "Reward", ("reward/mean", "reward/std", "reward/frac_zero_std")),
    Group("reward_functions", "Reward per function", ("reward/*/mean", "reward/*/std")),
    Group("policy", "Policy update", ("loss/*", "kl", "grad_norm", "entropy", "lr",
                                      "update_skipped")),
    Group("clipping", "Clip ratios", ("clip_ratio/*",)),
    Group("completions", "Completions", ("rollout/completion_length_mean",
                                         "rollout/completion_length_max",
                                         "rollout/completion_length_min",
                                         "rollout/truncated_fraction", "rollout/completion_tokens",
                                         "rollout/unresolved_zero_std_groups")),
    Group("engine_gap", "Engine vs trainer logprobs", ("rollout/logprob_abs_diff_mean",
                                                       "rollout/kl_trainer_vs_engine",
                                                       "rollout/is_weight_mean", "sync/*")),
    Group("time", "Time per phase (seconds)", ("time/*",)),
    Group("throughput", "Throughput and memory", ("perf/*", "memory/*")),
    Group("eval", "Evaluation", ("eval/*",)),
)
OTHER = Group("other", "Other metrics", ("*",))
# Keys for which a higher value is better: summary.md reports their best value and its step.
HIGHER_IS_BETTER = ("reward/mean", "reward/*/mean", "eval/reward/mean", "eval/reward/*/mean",
                    "perf/*_tokens_per_s")


def matching(keys: Sequence[str], patterns: Sequence[str]) -> List[str]:
    """The keys matching any pattern: in pattern order, sorted within one pattern."""
    found: List[str] = []
    for pattern in patterns:
        found += sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern) and k not in found)
    return found


def grouped(keys: Sequence[str], only: Sequence[str] = ()) -> List[Tuple[Group, List[str]]]:
    """(group, its keys) for every group with at least one logged key, then "other" for the
    keys no group names; `only` (patterns) keeps just the matching keys."""
    keys = matching(keys, only) if only else list(keys)
    result = [(g, matching(keys, g.patterns)) for g in GROUPS]
    named = {k for g, found in result if g.in_summary for k in found}
    result.append((OTHER, sorted(k for k in keys if k not in named)))
    return [(g, found) for g, found in result if found]


def higher_is_better(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in HIGHER_IS_BETTER)


UNTRAINED = "weight 0: not trained"


def reward_notes(keys: Sequence[str], record: Optional[dict]) -> Dict[str, str]:
    """{key: UNTRAINED} for the metrics of every --reward_funcs entry whose --reward_weights
    value is 0 (logged, but no part of the advantage), from the run's args.json record."""
    flags = (record or {}).get("flags") or {}
    weights = flags.get("reward_weights") or []
    untrained = {name for name, weight in zip(flags.get("reward_funcs") or [], weights)
                 if weight == 0}
    notes = {}
    for key in keys:
        parts = key.split("/")
        name = parts[2] if parts[:2] == ["eval", "reward"] and len(parts) > 3 else \
            parts[1] if parts[0] == "reward" and len(parts) > 2 else None
        if name in untrained:
            notes[key] = UNTRAINED
    return notes
