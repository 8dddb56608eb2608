"""The built-in rewards: accuracy, format, cosine, repetition, soft_overlong.

Semantics follow ms-swift / open-r1 (and DAPO for soft_overlong); docs/rewards.md describes
each one and its flags. Lengths are token counts from the `completion_ids` column the trainer
passes; called without it (e.g. from a notebook), they fall back to the number of characters.
"""
import math
import re
from typing import List, Optional, Sequence

from swift_megatron.errors import UserError
from swift_megatron.rewards.math_answer import answers_equal, extract_answer, extract_solution
from swift_megatron.rewards.registry import RewardConfig, _register_builtin


def _lengths(completions: Sequence[str], completion_ids: Optional[Sequence]) -> List[int]:
    if completion_ids is None:
        return [len(text) for text in completions]
    return [len(ids) for ids in completion_ids]


def accuracy_one(completion: str, solution, use_math_verify: Optional[bool] = None) -> Optional[float]:
    """1.0 if the completion's final answer equals the solution's, else 0.0; None when the
    solution is empty (nothing to compare with). See math_answer for extraction and comparison."""
    gold = extract_solution(solution)
    if gold is None:
        return None
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if answers_equal(pred, gold, use_math_verify=use_math_verify) else 0.0


@_register_builtin("accuracy")
def accuracy(completions: List[str], solution: List, **kwargs) -> List[Optional[float]]:
    """1.0 when the final answer (last \\boxed{}, else <answer>, else last number) equals the
    `solution` column's, else 0.0; None for rows with an empty solution."""
    return [accuracy_one(text, sol) for text, sol in zip(completions, solution)]


_FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


@_register_builtin("format")
def format_reward(completions: List[str], **kwargs) -> List[float]:
    """1.0 when the completion (stripped) is `<think>...</think>` then `<answer>...</answer>`
    and nothing else, else 0.0."""
    return [1.0 if _FORMAT.match(text.strip()) else 0.0 for text in completions]


@_register_builtin("cosine")
class CosineReward:
    """Length-scaled accuracy (open-r1 get_cosine_scaled_reward, arXiv:2502.03373): a correct
    answer earns cosine_min_len_value_correct when empty, falling along a half cosine to
    cosine_max_len_value_correct at cosine_max_len tokens; a wrong one goes from
    cosine_min_len_value_wrong to cosine_max_len_value_wrong. Lengths beyond cosine_max_len count
    as cosine_max_len. None where accuracy is None."""

    def __init__(self, config: RewardConfig):
        self.min_len_value_wrong = config.cosine_min_len_value_wrong
        self.max_len_value_wrong = config.cosine_max_len_value_wrong
        self.min_len_value_correct = config.cosine_min_len_value_correct
        self.max_len_value_correct = config.cosine_max_len_value_correct
        self.max_len = config.effective_cosine_max_len
        if self.max_len <= 0:
            raise UserError(f"--cosine_max_len must be > 0, got {self.max_len}")

    def value(self, length: int, correct: bool) -> float:
        if correct:
            min_value, max_value = self.max_len_value_correct, self.min_len_value_correct
        else:
            min_value, max_value = self.max_len_value_wrong, self.min_len_value_wrong
        progress = min(length / self.max_len, 1.0)
        cosine = math.cos(progress * math.pi)
        return min_value + 0.5 * (max_value - min_value) * (1.0 + cosine)

    def __call__(self, completions: List[str], solution: List, completion_ids=None,
                 **kwargs) -> List[Optional[float]]:
        correct = accuracy(completions, solution)
        lengths = _lengths(completions, completion_ids)
        return [None if acc is None else self.value(n, acc >= 1.0) for acc, n in zip(correct, lengths)]


@_register_builtin("repetition")
class RepetitionPenalty:
    """N-gram repetition penalty (open-r1 get_repetition_penalty_reward): over the lower-cased
    whitespace-split words, (1 - unique n-grams / n-grams) * repetition_max_penalty; 0 for texts
    shorter than n words."""

    def __init__(self, config: RewardConfig):
        self.n = config.repetition_n_grams
        self.max_penalty = config.repetition_max_penalty
        if self.n < 1:
            raise UserError(f"--repetition_n_grams must be >= 1, got {self.n}")
        if self.max_penalty > 0:
            raise UserError(f"--repetition_max_penalty must be <= 0 (it is a penalty), "
                            f"got {self.max_penalty}")

    def value(self, text: str) -> float:
        words = text.lower().split()
        if len(words) < self.n:
            return 0.0
        ngrams = list(zip(*[words[i:] for i in range(self.n)]))
        scaling = 1 - len(set(ngrams)) / len(ngrams)
        return scaling * self.max_penalty + 0.0  # + 0.0 turns -0.0 into 0.0

    def __call__(self, completions: List[str], **kwargs) -> List[float]:
        return [self.value(text) for text in completions]


@_register_builtin("soft_overlong")
class SoftOverlong:
    """DAPO's soft overlong punishment. With L = soft_max_length (default max_completion_length),
    C = soft_cache_length and n the completion's token count: 0 if n <= L - C,
    (L - C - n) / C if L - C < n <= L, -1 if n > L."""

    def __init__(self, config: RewardConfig):
        config.check_soft_overlong()
        self.max_length = config.effective_soft_max_length
        self.cache_length = config.soft_cache_length

    def value(self, length: int) -> float:
        expected = self.max_length - self.cache_length
        if length <= expected:
            return 0.0
        if length <= self.max_length:
            return (expected - length) / self.cache_length
        return -1.0

    def __call__(self, completions: List[str], completion_ids=None, **kwargs) -> List[float]:
        return [self.value(n) for n in _lengths(completions, completion_ids)]
