"""Rewards a tiny random model can learn in a few CPU minutes, used by `megatron demo` as an
--external_plugins file (and a complete example of the plugin API, see docs/rewards.md).

- digit_ratio: fraction of the completion's characters that are digits (dense, learned fast);
- contains_answer: 1 when the solution appears anywhere in the completion (a lenient accuracy
  that rises as the model learns to answer with digits);
- colour_parity: for the image task (fixtures `build_colour_dataset`), 1 when the parity of the
  first completion token id matches the square's colour (red: even, blue: odd). A random model
  scores about 0.5, and a model blind to the image cannot do better: above 0.5 means the pixels
  reach generation and training.
"""
from swift_megatron.rewards import register_reward


@register_reward("digit_ratio")
def digit_ratio(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


@register_reward("contains_answer")
def contains_answer(completions, solution, **kwargs):
    return [1.0 if str(answer) in text else 0.0 for text, answer in zip(completions, solution)]


@register_reward("first_token_even")
def first_token_even(completions, completion_ids, **kwargs):
    """1 when the completion's first token id is even: signal within every group of a random
    model, whatever its tokenizer decodes (the GPU gate's text tasks)."""
    return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]


@register_reward("colour_parity")
def colour_parity(completions, solution, completion_ids, **kwargs):
    return [float(bool(ids) and ids[0] % 2 == (0 if colour == "red" else 1))
            for ids, colour in zip(completion_ids, solution)]
