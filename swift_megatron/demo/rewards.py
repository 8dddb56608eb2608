"""Rewards a tiny random model can learn in a few CPU minutes, used by `megatron demo` as an
--external_plugins file (and a complete example of the plugin API, see docs/rewards.md).

- digit_ratio: fraction of the completion's characters that are digits (dense, learned fast);
- contains_answer: 1 when the solution appears anywhere in the completion (a lenient accuracy
  that rises as the model learns to answer with digits).
"""
from swift_megatron.rewards import register_reward


@register_reward("digit_ratio")
def digit_ratio(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


@register_reward("contains_answer")
def contains_answer(completions, solution, **kwargs):
    return [1.0 if str(answer) in text else 0.0 for text, answer in zip(completions, solution)]
