"""Reward functions: answer extraction and comparison, the built-ins' exact values, plugin
loading, name resolution and the checks on what reward functions return."""
import logging
import math
import subprocess
import sys
import textwrap

import pytest

from swift_megatron.errors import UserError
from swift_megatron.rewards import (BUILTIN_REWARDS, RewardConfig, compute_rewards, load_plugins,
                                    register_reward, resolve_reward_funcs)
from swift_megatron.rewards import math_answer, registry
from swift_megatron.rewards.builtin import (CosineReward, RepetitionPenalty, SoftOverlong, accuracy,
                                            accuracy_one, format_reward)


@pytest.fixture(autouse=True)
def _clean_registry():
    """Plugin registrations are process-global: undo each test's."""
    saved = dict(registry._REGISTERED)
    yield
    registry._REGISTERED.clear()
    registry._REGISTERED.update(saved)


@pytest.fixture
def no_math_verify(monkeypatch):
    """Behave as if math_verify were not installed, so our own normaliser decides."""
    monkeypatch.setattr(math_answer, "_math_verify", False)


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


# ---------------------------------------------------------------------------------------------
# Extraction


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}", "42"),
    (r"\boxed{1} then \boxed{2}", "2"),  # the last one
    (r"\boxed{\frac{1}{\sqrt{2}}} done", r"\frac{1}{\sqrt{2}}"),  # nested braces
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
    (r"\fbox{7}", "7"),
    (r"\boxed 9", "9"),
    (r"\boxed{unclosed", None),
])
def test_last_boxed(text, expected):
    assert math_answer.last_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    (r"<think>\boxed{3}</think><answer>4</answer>", "3"),  # boxed first, wherever it is
    ("<think>2+2</think><answer> 4 </answer>", "4"),
    ("<answer>1</answer> <answer>5</answer>", "5"),
    ("first 12 then 1,000.", "1,000"),
    ("so -3.5 is it", "-3.5"),
    ("ratio 3/4", "3/4"),
    ("no numbers here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert math_answer.extract_answer(text) == expected


def test_extract_solution():
    assert math_answer.extract_solution(r"The answer is $\boxed{\frac{2}{3}}$.") == r"\frac{2}{3}"
    assert math_answer.extract_solution("Natalia sold 48 ... #### 72") == "72"
    assert math_answer.extract_solution(" 5 ") == "5"
    assert math_answer.extract_solution(12) == "12"
    assert math_answer.extract_solution("") is None
    assert math_answer.extract_solution(None) is None


# ---------------------------------------------------------------------------------------------
# Our normaliser (independent of math_verify)


@pytest.mark.parametrize("pred, gold", [
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{1}{2}", "1/2"),
    (r"\tfrac12", "0.5"),
    ("1,000", "1000"),
    ("1,234,567.5", "1234567.5"),
    ("$42$", "42"),
    ("42.", "42"),
    ("42.0", "42"),
    (".5", "1/2"),
    (r"-\frac{3}{4}", "-0.75"),
    (r"\frac{-3}{4}", "-0.75"),
    ("0.3333333", r"\frac{1}{3}"),  # within 1e-6
    (r"\text{(B)}", "(b)"),  # \text unwrapped, case-insensitive
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"\! 7", "7"),
    ("x = 5", "5"),
    (r"45^\circ", "45"),
    (r"50\%", "50"),
    (r"\sqrt2", r"\sqrt{2}"),
    ("{3}", "3"),
])
def test_normalised_equal(pred, gold):
    assert math_answer.normalized_equal(pred, gold)
    assert math_answer.answers_equal(pred, gold, use_math_verify=False)


@pytest.mark.parametrize("pred, gold", [
    ("3", "4"),
    ("0.333", r"\frac{1}{3}"),  # outside 1e-6
    ("1,2", "12"),  # not a thousands separator
    ("1000001", "1000000"),
    (r"\sqrt{3}", r"\sqrt{2}"),
    ("", "1"),
    ("(A)", "(B)"),
])
def test_normalised_not_equal(pred, gold):
    assert not math_answer.normalized_equal(pred, gold)
    assert not math_answer.answers_equal(pred, gold, use_math_verify=False)


def test_to_number():
    assert math_answer.to_number(r"\frac{6}{4}") == math_answer.Fraction(3, 2)
    assert math_answer.to_number("1,000") == 1000
    assert math_answer.to_number("1/0") is None
    assert math_answer.to_number(r"\pi") is None


# ---------------------------------------------------------------------------------------------
# accuracy


ACCURACY_CASES = [
    (r"thus \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\frac{\sqrt{4}}{2}} hmm no, \boxed{1000}", "1,000", 1.0),  # last boxed, nested
    ("<think>...</think><answer>1,000</answer>", "1000", 1.0),
    ("<think>...</think><answer>7</answer>", "8", 0.0),
    ("we get 3 apples, then 5 more, total 8", "8", 1.0),  # last number
    ("the total is 8 apples, minus 3", "8", 0.0),  # last number is 3
    ("I don't know", "8", 0.0),  # no answer
    (r"\boxed{8}", r"The answer is $\boxed{8}$", 1.0),  # boxed solution
    (r"\boxed{9}", r"The answer is $\boxed{8}$", 0.0),
    ("the answer is 72", "blah blah #### 72", 1.0),
    ("anything", "", None),  # nothing to compare with
]


@pytest.mark.parametrize("completion, solution, expected", ACCURACY_CASES)
def test_accuracy_own_normaliser(no_math_verify, completion, solution, expected):
    assert accuracy([completion], [solution]) == [expected]
    assert accuracy_one(completion, solution, use_math_verify=False) == expected


@pytest.mark.parametrize("completion, solution, expected", ACCURACY_CASES)
def test_accuracy_default(completion, solution, expected):
    """The same values with math_verify consulted when it is installed."""
    assert accuracy([completion], [solution]) == [expected]


def test_accuracy_batch_ignores_extra_kwargs():
    out = accuracy([r"\boxed{2}", r"\boxed{3}"], ["2", "2"], prompts=["p", "p"], foo=[1, 2])
    assert out == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# format


@pytest.mark.parametrize("text, expected", [
    ("<think>a</think><answer>b</answer>", 1.0),
    ("  <think>\nline\n</think>\n\n<answer>\n42\n</answer>\n ", 1.0),
    ("<think></think> <answer></answer>", 1.0),
    ("<think>a</think><answer>b</answer> trailing", 0.0),
    ("preamble <think>a</think><answer>b</answer>", 0.0),
    ("<answer>b</answer>", 0.0),
    ("<think>a</think>", 0.0),
    ("<think>a</think> text <answer>b</answer>", 0.0),
    ("", 0.0),
])
def test_format(text, expected):
    assert format_reward([text]) == [expected]


# ---------------------------------------------------------------------------------------------
# cosine


def cosine_reward(max_len=100, **kwargs):
    return CosineReward(RewardConfig(cosine_max_len=max_len, **kwargs))


@pytest.mark.parametrize("length, correct_value, wrong_value", [
    (0, 1.0, -0.5),
    (25, 0.5 + 0.25 * (1 + math.cos(math.pi / 4)), -0.25 * (1 + math.cos(math.pi / 4))),
    (50, 0.75, -0.25),
    (75, 0.5 + 0.25 * (1 + math.cos(3 * math.pi / 4)), -0.25 * (1 + math.cos(3 * math.pi / 4))),
    (100, 0.5, 0.0),
    (150, 0.5, 0.0),  # past max_len: held at the max_len value
])
def test_cosine_values(no_math_verify, length, correct_value, wrong_value):
    reward = cosine_reward()
    ids = [list(range(length))] * 2
    out = reward([r"\boxed{1}", r"\boxed{2}"], solution=["1", "1"], completion_ids=ids)
    assert out == pytest.approx([correct_value, wrong_value], abs=1e-12)
    if length in (0, 100):  # the end points are exact
        assert out == [correct_value, wrong_value]


def test_cosine_hand_values():
    reward = cosine_reward()
    assert reward.value(25, True) == pytest.approx(0.9267766952966369, abs=1e-12)
    assert reward.value(25, False) == pytest.approx(-0.42677669529663687, abs=1e-12)


def test_cosine_custom_values_and_default_max_len():
    config = RewardConfig(cosine_min_len_value_wrong=-1.0, cosine_max_len_value_wrong=-0.2,
                          cosine_min_len_value_correct=2.0, cosine_max_len_value_correct=1.0,
                          max_completion_length=10)
    reward = CosineReward(config)
    assert reward.max_len == 10
    assert reward.value(0, True) == 2.0 and reward.value(10, True) == 1.0
    assert reward.value(0, False) == -1.0 and reward.value(10, False) == pytest.approx(-0.2)
    assert reward.value(5, True) == pytest.approx(1.5)


def test_cosine_falls_back_to_characters_and_skips_empty_solutions():
    reward = cosine_reward(max_len=4)
    assert reward(["1234"], solution=["1234"]) == [0.5]  # 4 characters = max_len, correct
    assert reward(["1234"], solution=[""]) == [None]


# ---------------------------------------------------------------------------------------------
# repetition


@pytest.mark.parametrize("text, n, expected", [
    ("a b c a b c", 3, -0.25),  # 4 trigrams, 3 unique
    ("A b C a B c", 3, -0.25),  # lower-cased
    ("a a a a a", 3, -(1 - 1 / 3)),
    ("a a a a a", 1, -(1 - 1 / 5)),
    ("the cat sat on the mat", 3, 0.0),
    ("the cat sat on the mat", 1, -(1 - 5 / 6)),
    ("one two", 3, 0.0),  # shorter than n
    ("", 3, 0.0),
])
def test_repetition(text, n, expected):
    reward = RepetitionPenalty(RewardConfig(repetition_n_grams=n))
    assert reward([text]) == [pytest.approx(expected, abs=1e-15)]


def test_repetition_max_penalty_scales_and_no_negative_zero():
    reward = RepetitionPenalty(RewardConfig(repetition_max_penalty=-2.0))
    assert reward(["a b c a b c"]) == [-0.5]
    assert math.copysign(1.0, reward(["all different words here"])[0]) == 1.0


# ---------------------------------------------------------------------------------------------
# soft_overlong


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (80, 0.0),  # <= L - C
    (81, -0.05),  # L - C + 1
    (90, -0.5),
    (100, -1.0),  # L
    (101, -1.0), (500, -1.0),  # > L
])
def test_soft_overlong(length, expected):
    reward = SoftOverlong(RewardConfig(soft_max_length=100, soft_cache_length=20))
    assert reward(["x"], completion_ids=[[0] * length]) == [pytest.approx(expected, abs=1e-15)]


def test_soft_overlong_defaults_to_max_completion_length():
    reward = SoftOverlong(RewardConfig(soft_cache_length=10, max_completion_length=50))
    assert reward(["x"] * 3, completion_ids=[[0] * 40, [0] * 45, [0] * 51]) == [0.0, -0.5, -1.0]


def test_soft_overlong_needs_cache_length():
    with pytest.raises(UserError, match="--soft_cache_length"):
        SoftOverlong(RewardConfig())
    with pytest.raises(UserError, match="--soft_cache_length must be in"):
        SoftOverlong(RewardConfig(soft_cache_length=512))


# ---------------------------------------------------------------------------------------------
# RewardConfig


def test_reward_config_from_grpo_args():
    from swift_megatron.arguments.grpo import GRPOArguments

    args = GRPOArguments(reward_funcs=["cosine"], cosine_max_len=64, repetition_n_grams=2,
                         max_completion_length=128)
    config = RewardConfig.from_args(args)
    assert config.cosine_max_len == 64 and config.repetition_n_grams == 2
    assert config.max_completion_length == 128
    assert config.cosine_min_len_value_correct == 1.0 and config.soft_max_length is None
    assert config.effective_soft_max_length == 128
    with pytest.raises(UserError, match="--soft_cache_length"):
        RewardConfig.from_args(GRPOArguments(reward_funcs=["accuracy", "soft_overlong"]))
    ok = RewardConfig.from_args(GRPOArguments(reward_funcs=["soft_overlong"], soft_cache_length=64))
    assert ok.soft_cache_length == 64


def test_reward_config_defaults_match_ms_swift():
    c = RewardConfig()
    assert (c.cosine_min_len_value_wrong, c.cosine_max_len_value_wrong, c.cosine_min_len_value_correct,
            c.cosine_max_len_value_correct, c.cosine_max_len) == (-0.5, 0.0, 1.0, 0.5, None)
    assert (c.repetition_n_grams, c.repetition_max_penalty) == (3, -1.0)
    assert (c.soft_max_length, c.soft_cache_length, c.max_completion_length) == (None, None, 512)


# ---------------------------------------------------------------------------------------------
# Registry and plugins

PLUGIN = """
    from swift_megatron.rewards import register_reward

    @register_reward("my_r")
    def registered(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def plain(completions, **kwargs):
        return [1.0 for _ in completions]

    def accuracy(completions, **kwargs):  # loses to the built-in of the same name
        return [-99.0 for _ in completions]

    @register_reward("my_cls")
    class Scaled:
        def __init__(self, config, repetition_n_grams, cosine_max_len, scale=3.0):
            self.value = scale * repetition_n_grams + cosine_max_len

        def __call__(self, completions, **kwargs):
            return [self.value] * len(completions)

    def echo(completions, prompts, difficulty, **kwargs):
        return [float(len(p)) + d for p, d in zip(prompts, difficulty)]
"""


def test_builtins_resolve():
    assert BUILTIN_REWARDS == ("accuracy", "cosine", "format", "repetition", "soft_overlong")
    funcs = resolve_reward_funcs(["accuracy", "format", "cosine", "repetition"], [], RewardConfig())
    assert [name for name, _ in funcs] == ["accuracy", "format", "cosine", "repetition"]
    assert funcs[0][1] is accuracy and funcs[1][1] is format_reward
    assert isinstance(funcs[2][1], CosineReward) and funcs[2][1].max_len == 512
    assert isinstance(funcs[3][1], RepetitionPenalty)


def test_plugin_registered_and_top_level(tmp_path):
    modules = load_plugins([write(tmp_path, "my_plugin.py", PLUGIN)])
    funcs = resolve_reward_funcs(["my_r", "plain", "accuracy", "my_cls"], modules,
                                 RewardConfig(repetition_n_grams=2, max_completion_length=10))
    assert funcs[0][1].__name__ == "registered"
    assert funcs[1][1].__name__ == "plain"
    assert funcs[2][1] is accuracy  # the built-in wins
    rewards = compute_rewards(funcs, ["ab", r"\boxed{5}"], solution=["ab", "5"])
    assert rewards == [[2.0, 9.0], [1.0, 1.0], [0.0, 1.0], [16.0, 16.0]]  # 3*2 + 10


def test_kwargs_reach_plugin_aligned(tmp_path):
    modules = load_plugins([write(tmp_path, "p.py", """
        seen = {}
        def spy(completions, **kwargs):
            seen.update(kwargs, completions=completions)
            return [float(d) for d in kwargs["difficulty"]]
        def echo(completions, prompts, difficulty):  # no **kwargs: gets only what it names
            return [len(p) + d for p, d in zip(prompts, difficulty)]
    """)])
    funcs = resolve_reward_funcs(["spy", "echo"], modules, RewardConfig())
    columns = dict(prompts=["p1", "prompt2"], difficulty=[3, 4], solution=["a", "b"],
                   completion_ids=[[1, 2], [3]], truncated=[False, True])
    out = compute_rewards(funcs, ["c1", "c2"], **columns)
    assert out == [[3.0, 4.0], [5.0, 11.0]]
    assert modules[0].seen == dict(columns, completions=["c1", "c2"])


def test_unknown_name_suggests_closest(tmp_path):
    modules = load_plugins([write(tmp_path, "p.py", PLUGIN)])
    with pytest.raises(UserError) as info:
        resolve_reward_funcs(["accuracy", "acuracy"], modules, RewardConfig())
    message = str(info.value)
    assert "'acuracy'" in message and "Did you mean 'accuracy'?" in message
    for name in ("accuracy", "format", "cosine", "repetition", "soft_overlong", "my_r", "my_cls",
                 "plain", "echo"):
        assert name in message
    assert "register_reward" not in message.split("Available:")[1]  # imported names not listed
    with pytest.raises(UserError, match="Did you mean 'plain'"):
        resolve_reward_funcs(["plan"], modules, RewardConfig())


def test_unknown_name_without_plugins():
    with pytest.raises(UserError, match="no --external_plugins"):
        resolve_reward_funcs(["my_thing"], [], RewardConfig())


def test_plugin_syntax_error_names_file(tmp_path):
    path = write(tmp_path, "broken_plugin.py", "def f(:\n    pass\n")
    with pytest.raises(UserError, match="broken_plugin.py") as info:
        load_plugins([path])
    assert "SyntaxError" in str(info.value)


def test_plugin_import_error_and_missing_file(tmp_path):
    path = write(tmp_path, "bad.py", "import not_a_real_module_xyz\n")
    with pytest.raises(UserError, match=r"bad\.py.*not_a_real_module_xyz"):
        load_plugins([path])
    with pytest.raises(UserError, match=r"nope\.py does not exist"):
        load_plugins([str(tmp_path / "nope.py")])


def test_plugin_cannot_register_builtin_name(tmp_path):
    path = write(tmp_path, "clash.py", """
        from swift_megatron.rewards import register_reward
        @register_reward("format")
        def mine(completions, **kwargs):
            return [0.0] * len(completions)
    """)
    with pytest.raises(UserError, match=r"clash\.py.*'format' is a built-in"):
        load_plugins([path])


def test_plugin_helper_module_next_to_it(tmp_path):
    write(tmp_path, "helper_mod_for_rewards.py", "VALUE = 0.25\n")
    modules = load_plugins([write(tmp_path, "uses_helper.py", """
        from helper_mod_for_rewards import VALUE
        def quarter(completions, **kwargs):
            return [VALUE] * len(completions)
    """)])
    funcs = resolve_reward_funcs(["quarter"], modules, RewardConfig())
    assert compute_rewards(funcs, ["a"]) == [[0.25]]


def test_same_file_loaded_twice(tmp_path):
    path = write(tmp_path, "p.py", PLUGIN)
    first, second = load_plugins([path, path])
    assert first.__name__ != second.__name__
    assert resolve_reward_funcs(["my_r"], [first, second], RewardConfig())[0][0] == "my_r"


def test_bare_register_reward_decorator():
    @register_reward
    def bare_reward_for_test(completions, **kwargs):
        return [0.0] * len(completions)

    funcs = resolve_reward_funcs(["bare_reward_for_test"], [], RewardConfig())
    assert funcs[0][1] is bare_reward_for_test


# ---------------------------------------------------------------------------------------------
# compute_rewards checks


def test_wrong_length_is_user_error():
    def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(UserError, match=r"'short' returned 1 values for 2 completions"):
        compute_rewards([("short", short)], ["a", "b"])


@pytest.mark.parametrize("returned, match", [
    (1.0, "returned float"),
    ("1", "returned str"),
    ([1.0, "x"], r"non-number at index 1: 'x'"),
    ([1.0, [2.0]], r"non-number at index 1"),
    ([1.0, float("nan")], r"returned nan for completion 1: rewards must be finite"),
    ([float("inf"), 0.0], r"returned inf for completion 0"),
    ([1.0, float("-inf")], r"returned -inf for completion 1"),
])
def test_bad_return_is_user_error(returned, match):
    with pytest.raises(UserError, match=r"'bad'.*" + match):
        compute_rewards([("bad", lambda completions, **kw: returned)], ["a", "b"])


def test_none_ints_and_bools_accepted():
    out = compute_rewards([("ok", lambda completions, **kw: [None, 1, True])], ["a", "b", "c"])
    assert out == [[None, 1.0, 1.0]]
    assert all(v is None or type(v) is float for v in out[0])


def test_called_once_per_batch():
    calls = []

    def counting(completions, **kwargs):
        calls.append(len(completions))
        return [0.0] * len(completions)

    compute_rewards([("counting", counting)], ["a", "b", "c"], prompts=["p"] * 3)
    assert calls == [3]


def test_missing_column_is_user_error():
    funcs = resolve_reward_funcs(["accuracy"], [], RewardConfig())
    with pytest.raises(UserError, match=r"'accuracy' needs the column\(s\) solution.*prompts"):
        compute_rewards(funcs, ["a"], prompts=["p"])


def test_a_raising_reward_function_is_named_with_the_sample(tmp_path):
    """A plugin's exception stops the run as a UserError (exit 2, no traceback) that names the
    function, the line of the plugin that raised and the first completion it fails on."""
    plugin = tmp_path / "fragile.py"
    plugin.write_text(textwrap.dedent("""
        def fragile(completions, solution, **kwargs):
            return [float(s) / len(c) for c, s in zip(completions, solution)]
    """))
    namespace = {}
    exec(compile(plugin.read_text(), str(plugin), "exec"), namespace)
    with pytest.raises(UserError, match=r"reward function 'fragile' raised ZeroDivisionError: "
                                        r"float division by zero \(at .*fragile.py:3, in ") as info:
        compute_rewards([("fragile", namespace["fragile"])], ["ab", "", "c"],
                        solution=["1", "2", "3"])
    assert "first failing completion #1: ''" in str(info.value)

    async def broken(completions, **kwargs):
        raise KeyError("x")

    with pytest.raises(UserError, match=r"reward function 'broken' raised KeyError: 'x'"):
        compute_rewards([("broken", broken)], ["a"])


def test_package_does_not_import_torch():
    code = "import sys, swift_megatron.rewards; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# --reward_error_policy skip: a completion a reward function raises on scores as missing


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    handler = _Records()
    logging.getLogger("swift_megatron").addHandler(handler)
    yield handler.messages
    logging.getLogger("swift_megatron").removeHandler(handler)


def _by_first_token(completions, completion_ids, **kwargs):
    return [{20: 2.0, 40: 4.0, 60: 6.0}[ids[0]] for ids in completion_ids]  # KeyError for 0


def _ones(completions, **kwargs):
    return [1.0] * len(completions)


def test_skip_scores_the_raising_completion_as_missing(warnings_logged):
    funcs = [("table", _by_first_token), ("one", _ones)]
    ids = [[20, 5], [40, 5], [0, 5], [60, 5]]
    values, raised = registry.score_rewards(funcs, ["a", "b", "c", "d"], {"completion_ids": ids},
                                            on_error="skip")
    assert values == [[2.0, 4.0, None, 6.0], [1.0] * 4] and raised == [[2], []]
    [message] = warnings_logged
    assert "reward function 'table' raised on 1 of 4 completion(s), scored as missing" in message
    assert "#2 'c': KeyError: 0 (at " in message and "test_rewards.py" in message
    with pytest.raises(UserError, match="'table' raised KeyError: 0 .*first failing completion #2"):
        registry.score_rewards(funcs, ["a", "b", "c", "d"], {"completion_ids": ids})

    async def broken(completions, **kwargs):   # asynchronous: retried and awaited one by one
        if "c" in completions:
            raise ValueError("c is bad")
        return [0.5] * len(completions)

    values, raised = registry.score_rewards([("broken", broken)], ["a", "c"], {}, on_error="skip")
    assert values == [[0.5, None]] and raised == [[1]]
    assert "#1 'c': ValueError: c is bad" in warnings_logged[-1]


class _FixedEngine:
    """Completions with the given token ids, in request order."""

    weight_version = 1

    def __init__(self, token_ids):
        self.token_ids = token_ids

    def generate(self, prompts, sampling, seeds=None):
        from swift_megatron.rollout.engine import Completion

        return [Completion(list(ids), [-0.5] * len(ids), "length", 1) for ids in self.token_ids]


def test_collector_skip_policy_advantages_by_hand(single_process_group, warnings_logged):
    """One group of four: table = 2, 4, (raises), 6 and one = 1 each -> weighted rewards 3, 5, 1, 7
    (the missing reward counts 0), mean 4, unbiased std sqrt(20/3) -> advantages
    (r - 4) / (std + 1e-4); reward/table/errors counts the completion."""
    import torch

    from swift_megatron.rlhf.grpo.collect import CollectSettings, RolloutCollector
    from swift_megatron.rollout.engine import SamplingConfig
    from swift_megatron.fixtures.tokenizer import load_tokenizer
    from tests.unit.test_multi_turn import prompt_of

    tok = load_tokenizer()
    settings = CollectSettings(num_generations=4, sampling=SamplingConfig(max_tokens=2),
                               reward_names=["table", "one"], reward_weights=[1.0, 1.0],
                               scale_rewards="group", dynamic_sample=False, max_resample_times=0,
                               reward_error_policy="skip")
    funcs = [("table", _by_first_token), ("one", _ones)]
    collector = RolloutCollector(_FixedEngine([[20, 5], [40, 5], [0, 5], [60, 5]]), funcs, tok,
                                 settings, single_process_group, single_process_group,
                                 lambda n: [], torch.device("cpu"))
    samples, _ = collector.collect([prompt_of(tok)], [0], seed=1)
    metrics = collector.assign_advantages(samples)
    std = math.sqrt(20 / 3)
    assert [s.reward for s in samples] == [3.0, 5.0, 1.0, 7.0]
    assert [s.rewards[0] for s in samples] == [2.0, 4.0, None, 6.0]
    assert [s.advantage for s in samples] == pytest.approx(
        [(r - 4) / (std + 1e-4) for r in (3, 5, 1, 7)], abs=1e-9)
    assert metrics["reward/table/errors"] == 1.0 and metrics["reward/one/errors"] == 0.0
    assert metrics["reward/table/mean"] == pytest.approx(4.0)
    assert metrics["reward/mean"] == pytest.approx(4.0)
    assert any("reward function 'table' raised on 1 of 4" in m for m in warnings_logged)


def test_reward_error_policy_flag():
    from tests.unit.test_grpo_arguments import grpo

    assert grpo().reward_error_policy == "raise"
    assert grpo("--reward_error_policy", "skip").reward_error_policy == "skip"
