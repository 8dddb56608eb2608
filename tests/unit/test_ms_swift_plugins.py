"""Plugin files written against ms-swift's plugin API (swift.rewards, swift.rollout, ...): they
load through --external_plugins without ms-swift (a stand-in `swift` package that exists only
during the import) and against a real ms-swift when one is installed; their registrations reach
our registries; rewards get ms-swift's `args` and keyword arguments, and async ones are awaited."""
import asyncio
import importlib.util
import logging
import os
import sys
import textwrap
from types import ModuleType, SimpleNamespace

import pytest
import torch

from swift_megatron.compat.ms_swift import flat_args, protocol, rollout, shim
from swift_megatron.compat.ms_swift.utils import get_logger, to_device
from swift_megatron.data import Prompt
from swift_megatron.errors import UserError
from swift_megatron.rewards import (RewardConfig, compute_rewards, load_plugins, registered_names,
                                    resolve_reward_funcs)
from swift_megatron.rewards import registry
from swift_megatron.rlhf.grpo.collect import TrainerState, reward_columns
from swift_megatron.rollout.engine import Completion
from swift_megatron.rollout.plugin_registry import GYM_ENVS, RM_PLUGINS, SCHEDULERS

DETECT_MS_SWIFT = shim.ms_swift_installed
MS_SWIFT_PLUGIN = "/tmp/msswift/examples/train/grpo/plugin/plugin.py"


def swift_modules():
    return {name: module for name, module in sys.modules.items()
            if name == "swift" or name.startswith("swift.")}


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Undo each test's registrations and `swift*` modules; behave as if ms-swift were absent
    (the stand-in path) unless a test restores DETECT_MS_SWIFT."""
    monkeypatch.setattr(shim, "ms_swift_installed", lambda: False)
    rewards = dict(registry._REGISTERED)
    others = [(r, dict(r._classes), dict(r._sources)) for r in (GYM_ENVS, SCHEDULERS, RM_PLUGINS)]
    modules = swift_modules()
    yield
    registry._REGISTERED.clear()
    registry._REGISTERED.update(rewards)
    for reg, classes, sources in others:
        reg._classes, reg._sources = classes, sources
    for name in set(swift_modules()) - set(modules):
        del sys.modules[name]


def write(folder, name, source):
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return str(path)


# ---------------------------------------------------------------------------------------------
# Loading against the stand-in


EVERY_NAME = """
    import asyncio
    from swift.infer_engine import RequestConfig, TransformersEngine
    from swift.infer_engine.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice,
                                             RolloutInferRequest, RolloutOutput)
    from swift.rewards import ORM, AsyncORM, orms, rm_plugins
    from swift.rewards.rm_plugin import DefaultRMPlugin
    from swift.rollout.gym_env import Env, envs
    from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns
    from swift.template import Template, Messages
    from swift.utils import get_logger, to_device
    import swift.rewards

    logger = get_logger()


    class LengthReward(ORM):
        def __call__(self, completions, **kwargs):
            return [float(len(c)) / self.args.max_completion_length for c in completions]


    class SlowReward(AsyncORM):
        async def __call__(self, completions, **kwargs):
            await asyncio.sleep(0)
            return [1.0 for _ in completions]


    def starts_with_a(completions, **kwargs):
        return [float(c.startswith("a")) for c in completions]


    class Echo(Env):
        async def reset(self, config: RolloutInferRequest):
            return config.data_dict["question"], {}, "be brief"

        async def step(self, action: Messages):
            return "done", 1.0, True, {}

        async def close(self):
            pass


    class Tips(MultiTurnScheduler):
        def step(self, infer_request, response_choice, current_turn):
            return {"infer_request": infer_request}


    class JudgePlugin(DefaultRMPlugin):
        pass


    orms["length"] = LengthReward
    orms["slow"] = SlowReward
    swift.rewards.orms["starts_with_a"] = starts_with_a
    envs["echo"] = Echo
    multi_turns["tips"] = Tips
    rm_plugins["judge"] = JudgePlugin
"""


def test_every_name_imports_and_registrations_reach_our_registries(tmp_path):
    before = swift_modules()
    (module,) = load_plugins([write(tmp_path, "every_name.py", EVERY_NAME)])
    assert swift_modules() == before == {}
    assert {"length", "slow", "starts_with_a"} <= set(registered_names())
    assert registry._REGISTERED["length"] is module.LengthReward
    assert GYM_ENVS.lookup("echo") is module.Echo
    assert SCHEDULERS.lookup("tips") is module.Tips
    assert RM_PLUGINS.lookup("judge") is module.JudgePlugin
    assert issubclass(module.Echo, rollout.Env)
    assert issubclass(module.Tips, rollout.MultiTurnScheduler)
    assert module.orms["length"] is module.LengthReward  # the plugin keeps its references
    assert isinstance(module.logger, logging.Logger)


def test_orm_gets_args_and_async_rewards_are_awaited(tmp_path):
    modules = load_plugins([write(tmp_path, "every_name.py", EVERY_NAME)])
    args = SimpleNamespace(max_completion_length=4)
    funcs = resolve_reward_funcs(["length", "slow", "starts_with_a", "format"], modules,
                                 RewardConfig(), init_kwargs={"args": args})
    assert funcs[0][1].args is args
    assert compute_rewards(funcs, ["ab", "bcde"]) == [[0.5, 1.0], [1.0, 1.0], [1.0, 0.0],
                                                      [0.0, 0.0]]


def test_unknown_swift_module_is_explained_and_modules_restored(tmp_path, monkeypatch):
    outsider = ModuleType("swift")  # an unrelated module that happened to be imported already
    monkeypatch.setitem(sys.modules, "swift", outsider)
    path = write(tmp_path, "uses_trainers.py", "from swift.trainers import Seq2SeqTrainer\n")
    with pytest.raises(UserError) as info:
        load_plugins([path])
    message = str(info.value)
    assert "uses_trainers.py" in message and "No module named 'swift.trainers'" in message
    assert "swift.rewards, swift.rewards.orm" in message and "install ms-swift" in message
    assert swift_modules() == {"swift": outsider}


def test_missing_name_is_explained(tmp_path):
    path = write(tmp_path, "missing_name.py", "from swift.rewards.orm import MathAccuracy\n")
    with pytest.raises(UserError, match=r"cannot import name 'MathAccuracy'.*install ms-swift"):
        load_plugins([path])
    assert swift_modules() == {}


def test_rlhf_flags_reach_orm_as_args(tmp_path):
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.rlhf.grpo import components

    path = write(tmp_path, "every_name.py", EVERY_NAME)
    argv = ["--model", "m", "--dataset", "d", "--external_plugins", path, "--reward_funcs",
            "length", "slow", "--max_completion_length", "8", "--num_generations", "2"]
    args = parse_command(RlhfArguments, argv, "megatron rlhf")
    (_, length), (_, slow) = components.rewards(args)
    assert (length.args.max_completion_length, length.args.num_generations) == (8, 2)
    assert (length.args.model, length.args.external_plugins) == ("m", [path])
    assert vars(slow.args) == vars(length.args)
    assert compute_rewards([("length", length)], ["abcd"]) == [[0.5]]


def test_import_of_swift_after_loading_is_explained(tmp_path):
    modules = load_plugins([write(tmp_path, "late.py", """
        from swift.rewards import ORM, orms
        class Late(ORM):
            def __init__(self, args=None, **kwargs):
                super().__init__(args)
                from swift.rewards.orm import ORM as again
        orms["late"] = Late
    """)])
    with pytest.raises(UserError, match=r"^reward 'late': creating Late failed: No module named "
                                        r"'swift'\. .*import it at the top of the plugin file"):
        resolve_reward_funcs(["late"], modules, RewardConfig())


def test_failed_import_leaves_no_swift_and_registers_nothing(tmp_path):
    path = write(tmp_path, "fails.py", """
        from swift.rewards import ORM, orms
        class Half(ORM):
            def __call__(self, completions, **kwargs):
                return [0.5] * len(completions)
        orms["half"] = Half
        raise RuntimeError("boom")
    """)
    with pytest.raises(UserError, match=r"fails\.py failed: RuntimeError: boom"):
        load_plugins([path])
    assert swift_modules() == {} and "half" not in registered_names()


def test_builtin_name_and_bad_registrations(tmp_path):
    clash = write(tmp_path, "clash.py", """
        from swift.rewards import ORM, orms
        orms["format"] = ORM
    """)
    with pytest.raises(UserError, match=r"clash\.py.*orms\['format'\]: 'format' is a built-in"):
        load_plugins([clash])
    not_class = write(tmp_path, "not_class.py", """
        from swift.rollout.gym_env import envs
        envs["bad"] = lambda config: None
    """)
    with pytest.raises(UserError, match=r"not_class\.py.*gym env 'bad' must be a class, got "
                                        r"function"):
        load_plugins([not_class])
    not_callable = write(tmp_path, "not_callable.py", """
        from swift.rewards import orms
        orms["num"] = 3
    """)
    with pytest.raises(UserError, match=r"orms\['num'\]: expected a function or a class, got int"):
        load_plugins([not_callable])


def test_lookup_of_unknown_names():
    GYM_ENVS.register("frozen_lake", type("FrozenLake", (), {}), "lake.py")
    with pytest.raises(UserError, match=r"--gym_env: unknown gym env 'frozen_lak'\. Did you mean "
                                        r"'frozen_lake'\? Registered: frozen_lake"):
        GYM_ENVS.lookup("frozen_lak")
    with pytest.raises(UserError, match=r"--multi_turn_scheduler: unknown multi-turn scheduler "
                                        r"'anything'\. Registered: calculator, gym_scheduler"):
        SCHEDULERS.lookup("anything")   # the built-ins (rollout/multi_turn/builtin.py)


@pytest.mark.parametrize("name", ["math_tip_trick", "math_tip_trick_multi_turn",
                                  "thinking_tips_scheduler", "base_scheduler"])
def test_ms_swift_builtin_schedulers_get_the_reason_before_the_model(name, tmp_path):
    """ms-swift's built-in scheduler names that are not ours (issue 40): the lookup says why and
    what to do instead, and a run without plugin files (which might register the name) stops
    in its preflight, before any model is built; a plugin's class of that name wins."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.preflight import check_scheduler_name

    with pytest.raises(UserError, match=rf"^--multi_turn_scheduler {name}: ms-swift's .*"
                                        r"(drop --multi_turn_scheduler|plugin)"):
        SCHEDULERS.lookup(name)
    argv = ["--model", "m", "--dataset", "d", "--multi_turn_scheduler", name]
    with pytest.raises(UserError, match=rf"^--multi_turn_scheduler {name}: ms-swift's"):
        check_scheduler_name(parse_command(RlhfArguments, argv, "megatron rlhf"))
    plugin = tmp_path / "tips.py"
    plugin.write_text("")
    check_scheduler_name(parse_command(RlhfArguments, [*argv, "--external_plugins", str(plugin)],
                                       "megatron rlhf"))   # the plugin may register it
    SCHEDULERS.register(name, type("Tips", (), {}), "tips.py")
    try:
        assert SCHEDULERS.lookup(name).__name__ == "Tips"
    finally:
        SCHEDULERS._classes.pop(name)
        SCHEDULERS._sources.pop(name)


# ---------------------------------------------------------------------------------------------
# Names that need ms-swift


@pytest.mark.parametrize("name", ["TransformersEngine", "VllmEngine", "InferClient", "Template",
                                  "DefaultRMPlugin"])
def test_stand_ins_raise_when_created(tmp_path, name):
    (module,) = load_plugins([write(tmp_path, "uses_stub.py", f"""
        from swift.infer_engine import TransformersEngine, VllmEngine, InferClient
        from swift.rewards.rm_plugin import DefaultRMPlugin
        from swift.template import Template

        class Mine({name}):
            pass
    """)])
    with pytest.raises(UserError, match=rf"^{name} needs ms-swift: {name} is ms-swift's .*pip "
                                        r"install ms-swift"):
        getattr(module, name)("model", template=None)
    with pytest.raises(UserError, match=rf"^Mine \(a subclass of {name}\) needs ms-swift"):
        module.Mine()


def test_scheduler_defaults_and_run_needs_multi_turn_support():
    class Tips(rollout.MultiTurnScheduler):
        pass

    scheduler = Tips(max_turns=2, tokenizer="tok")
    message = protocol.ChatMessage("assistant", "hi")
    choice = protocol.ChatCompletionResponseChoice(0, message, "stop")
    request = protocol.RolloutInferRequest(messages=[{"role": "user", "content": "q"}])
    assert scheduler.tokenizer == "tok" and scheduler.engine is None
    assert [scheduler.check_finished(request, choice, turn) for turn in (1, 2)] == [False, True]
    choice.finish_reason = "length"
    assert scheduler.check_finished(request, choice, 1) is True
    assert asyncio.run(scheduler.on_turn_end(request, choice, 1)) == {}
    with pytest.raises(NotImplementedError, match="Tips must implement step"):
        scheduler.step(request, choice, 1)
    with pytest.raises(UserError, match=r"Tips\.run: swift-megatron runs multi-turn rollouts "
                                        r"itself"):
        asyncio.run(scheduler.run(request, protocol.RequestConfig()))
    with pytest.raises(TypeError, match="abstract"):
        rollout.Env({})


def test_orm_without_call_names_the_class(tmp_path):
    (module,) = load_plugins([write(tmp_path, "no_call.py", """
        from swift.rewards import ORM, AsyncORM
        class Forgot(ORM):
            pass
        class ForgotToo(AsyncORM):
            pass
    """)])
    for cls, base in ((module.Forgot, "ORM"), (module.ForgotToo, "AsyncORM")):
        with pytest.raises(UserError, match=rf"{cls.__name__} subclasses {base} but does not "
                                            r"define __call__"):
            compute_rewards([("x", cls())], ["a"])


def test_utils_get_logger_and_to_device(tmp_path):
    log_file = tmp_path / "plugin.log"
    logger = get_logger(str(log_file))
    assert get_logger(str(log_file)) is logger
    logger.warning("hello from a plugin")
    assert log_file.read_text() == "hello from a plugin\n"
    for handler in [h for h in logger.handlers if getattr(h, "baseFilename", None)]:
        logger.removeHandler(handler)
        handler.close()
    batch = {"ids": torch.ones(2), "rows": [torch.zeros(1), "text"], "n": 3}
    moved = to_device(batch, "meta")
    assert moved["ids"].device.type == "meta" and moved["rows"][0].device.type == "meta"
    assert moved["rows"][1] == "text" and moved["n"] == 3 and isinstance(moved["rows"], list)


def test_flat_args():
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command

    args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--beta", "0.1",
                                         "--num_generations", "4"], "megatron rlhf")
    flat = flat_args(args)
    assert (flat.beta, flat.num_generations, flat.model, flat.dataset) == (0.1, 4, "m", ["d"])
    assert not hasattr(flat, "explicit") and not hasattr(flat, "adjustments")


# ---------------------------------------------------------------------------------------------
# Calling: ms-swift's keyword arguments, async rewards


def test_reward_columns_carry_ms_swift_names(tmp_path):
    (module,) = load_plugins([write(tmp_path, "spy.py", """
        from swift.rewards import ORM, orms
        seen = {}
        class Spy(ORM):
            def __call__(self, completions, messages, trainer_state, **kwargs):
                seen.update(kwargs, messages=messages, trainer_state=trainer_state)
                return [float(trainer_state.global_step)] * len(completions)
        orms["spy"] = Spy
    """)])
    prompts = [Prompt(7, "<q>", [1, 2], [{"role": "user", "content": "2+2?"}], {"solution": "4"})]
    completions = [Completion([5, 6], None, "stop"), Completion([7], None, "length")]
    columns = reward_columns(prompts * 2, [30, 30], completions, ["four", "4"],
                             TrainerState(global_step=3, max_steps=10))
    funcs = resolve_reward_funcs(["spy"], [module], RewardConfig())
    assert compute_rewards(funcs, ["four", "4"], **columns) == [[3.0, 3.0]]
    seen = module.seen
    assert seen["messages"] == [[{"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "content": "four"}],
                                [{"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "content": "4"}]]
    assert seen["trainer_state"] == TrainerState(3, 10)
    seen["messages"][0][0]["content"] = "changed"  # a reward cannot alter the prompt
    assert prompts[0].messages[0]["content"] == "2+2?"
    del seen["messages"], seen["trainer_state"]
    assert seen == {
        "prompt_id": [30, 30], "finish_reason": ["stop", "length"],
        "is_truncated": [False, True], "truncated": [False, True],
        "response_token_ids": [[[5, 6]], [[7]]], "completion_ids": [[5, 6], [7]],
        "prompts": ["<q>", "<q>"], "solution": ["4", "4"]}


def test_dataset_columns_win_over_ms_swift_names_as_in_ms_swift():
    prompt = Prompt(0, "q", [1], [{"role": "user", "content": "q"}], {"prompt_id": "row-17"})
    columns = reward_columns([prompt], [5], [Completion([1], None, "stop")], ["4"], TrainerState())
    assert columns["prompt_id"] == ["row-17"] and columns["completion_ids"] == [[1]]


def test_function_without_kwargs_gets_only_its_columns():
    def exact(completions, solution):
        return [float(c == s) for c, s in zip(completions, solution)]

    prompt = Prompt(0, "q", [1], [{"role": "user", "content": "q"}], {"solution": "4"})
    columns = reward_columns([prompt], [0], [Completion([1], None, "stop")], ["4"], TrainerState())
    assert compute_rewards([("exact", exact)], ["4"], **columns) == [[1.0]]


def test_async_rewards_run_concurrently():
    order = []

    async def first(completions, **kwargs):
        order.append("first starts")
        await asyncio.sleep(0)
        order.append("first ends")
        return [1.0] * len(completions)

    class Second:
        async def __call__(self, completions, **kwargs):
            order.append("second starts")
            await asyncio.sleep(0)
            order.append("second ends")
            return [None] * len(completions)

    def sync(completions, **kwargs):
        order.append("sync")
        return [0.5] * len(completions)

    out = compute_rewards([("first", first), ("second", Second()), ("sync", sync)], ["a", "b"])
    assert out == [[1.0, 1.0], [None, None], [0.5, 0.5]]
    assert order == ["sync", "first starts", "second starts", "first ends", "second ends"]


def test_async_errors_are_named_and_checked():
    async def boom(completions, **kwargs):
        raise KeyError("x")

    with pytest.raises(UserError, match=r"reward function 'boom' raised KeyError: 'x'"):
        compute_rewards([("boom", boom)], ["a"])

    async def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(UserError, match=r"'short' returned 1 values for 2 completions"):
        compute_rewards([("short", short)], ["a", "b"])


def test_pending_coroutines_closed_when_a_later_reward_fails():
    closed = []

    class Pending:
        def __await__(self):
            yield

        def close(self):
            closed.append(True)

    def failing(completions, **kwargs):
        raise ValueError("bad")

    with pytest.raises(UserError, match="'failing' raised ValueError: bad"):
        compute_rewards([("pending", lambda completions, **kw: Pending()), ("failing", failing)],
                        ["a"])
    assert closed == [True]


# ---------------------------------------------------------------------------------------------
# Scoring: countdown and multimodal-accuracy style checkers written against the API


CHECKERS = """
    import ast
    import re
    from swift.rewards import ORM, orms

    def tag(text, name):
        found = re.search(rf"<{name}>(.*?)</{name}>", text, re.DOTALL)
        return found.group(1).strip() if found else None

    def arithmetic(node):
        if isinstance(node, ast.Expression):
            return arithmetic(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp):
            left, right = arithmetic(node.left), arithmetic(node.right)
            ops = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right,
                   ast.Mult: lambda: left * right, ast.Div: lambda: left / right}
            return ops[type(node.op)]()
        raise ValueError("not arithmetic")

    class Countdown(ORM):
        \"\"\"1 when the <answer> equation uses each of `nums` once and evaluates to `target`.\"\"\"
        def __call__(self, completions, target, nums, **kwargs):
            return [self.one(c, t, n) for c, t, n in zip(completions, target, nums)]

        @staticmethod
        def one(completion, target, nums):
            equation = tag(completion, "answer")
            if equation is None:
                return 0.0
            equation = equation.split("=")[0]
            if sorted(int(d) for d in re.findall(r"\\d+", equation)) != sorted(nums):
                return 0.0
            try:
                value = arithmetic(ast.parse(equation, mode="eval"))
            except (ValueError, SyntaxError, KeyError, ZeroDivisionError):
                return 0.0
            return 1.0 if abs(value - float(target)) < 1e-5 else 0.0

    class AnswerMatch(ORM):
        \"\"\"1 when the <answer> of the completion equals the solution's (or the whole text).\"\"\"
        def __call__(self, completions, solution, **kwargs):
            def answer(text):
                inner = tag(text, "answer")
                return inner if inner is not None else text.strip()
            return [float(answer(c) == answer(s)) for c, s in zip(completions, solution)]

    orms["my_countdown"] = Countdown
    orms["my_r1v_acc"] = AnswerMatch
"""

COUNTDOWN_CASES = [  # completion, target, nums, reward
    ("<think>..</think><answer>(1 + 2) * 3</answer>", 9, [1, 2, 3], 1.0),
    ("<answer>(9 - 1) * 2 = 16</answer>", 16, [9, 1, 2], 1.0),  # '= result' is ignored
    ("<answer>1 + 2 + 3 = 9</answer>", 9, [1, 2, 3], 0.0),  # evaluates to 6
    ("<answer>3 * 3</answer>", 9, [1, 2, 3], 0.0),  # numbers not used exactly once
    ("<answer>(1 + 2) * 3 + 0</answer>", 9, [1, 2, 3], 0.0),  # an extra number
    ("<answer>__import__('os')</answer>", 9, [], 0.0),
    ("(1 + 2) * 3", 9, [1, 2, 3], 0.0),  # no answer tag
]

R1V_CASES = [  # completion, solution, reward
    ("<think>count</think><answer>3</answer>", "<answer>3</answer>", 1.0),
    ("<think>count</think><answer> 3 </answer>", "3", 1.0),
    ("<answer>4</answer>", "<answer>3</answer>", 0.0),
    ("no tags here", "<answer>3</answer>", 0.0),
    ("<answer>Paris</answer>", "<answer>Paris</answer>", 1.0),
]


def test_countdown_and_answer_match_checkers(tmp_path):
    modules = load_plugins([write(tmp_path, "checkers.py", CHECKERS)])
    funcs = resolve_reward_funcs(["my_countdown", "my_r1v_acc"], modules, RewardConfig(),
                                 init_kwargs={"args": SimpleNamespace()})
    countdown = compute_rewards(funcs[:1], [c[0] for c in COUNTDOWN_CASES],
                                target=[c[1] for c in COUNTDOWN_CASES],
                                nums=[c[2] for c in COUNTDOWN_CASES])
    assert countdown == [[c[3] for c in COUNTDOWN_CASES]]
    r1v = compute_rewards(funcs[1:], [c[0] for c in R1V_CASES], solution=[c[1] for c in R1V_CASES])
    assert r1v == [[c[2] for c in R1V_CASES]]


# ---------------------------------------------------------------------------------------------
# A real ms-swift installed


FAKE_MS_SWIFT = {
    "swift/__init__.py": "",
    "swift/rewards/__init__.py": "from .orm import ORM, AsyncORM, orms\nrm_plugins = {}\n",
    "swift/rewards/orm.py": """
        class ORM:
            def __init__(self, args=None, **kwargs):
                self.args = args
        class AsyncORM(ORM):
            pass
        class Accuracy(ORM):
            def __call__(self, completions, **kwargs):
                return [1.0] * len(completions)
        orms = {"ms_swift_builtin": Accuracy}
    """,
    "swift/rollout/__init__.py": "",
    "swift/rollout/gym_env.py": "class Env:\n    pass\nenvs = {'math_env': Env}\n",
    "swift/rollout/multi_turn.py": "class MultiTurnScheduler:\n    pass\nmulti_turns = {}\n",
}


def test_real_ms_swift_is_used_not_shadowed(tmp_path, monkeypatch):
    for name, source in FAKE_MS_SWIFT.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write(tmp_path, name, source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(shim, "ms_swift_installed", DETECT_MS_SWIFT)
    assert shim.ms_swift_installed()
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (module,) = load_plugins([write(plugin, "against_real.py", """
        from swift.rewards import ORM, orms
        from swift.rollout.gym_env import Env, envs
        class Double(ORM):
            def __call__(self, completions, **kwargs):
                return [2.0 * self.args.scale] * len(completions)
        class Lake(Env):
            pass
        orms["double"] = Double
        envs["lake"] = Lake
    """)])
    real_orm = sys.modules["swift.rewards.orm"]
    assert real_orm.__file__ == str(tmp_path / "swift/rewards/orm.py")  # still imported
    assert module.ORM is real_orm.ORM and real_orm.orms["double"] is module.Double
    assert "ms_swift_builtin" not in registered_names()  # only what the plugin added
    assert GYM_ENVS.names() == ["grid_world", "lake"]   # the built-in and the plugin's
    funcs = resolve_reward_funcs(["double"], [module], RewardConfig(),
                                 init_kwargs={"args": SimpleNamespace(scale=1.5)})
    assert compute_rewards(funcs, ["a"]) == [[3.0]]


def test_detection_needs_a_swift_package_with_rewards(tmp_path, monkeypatch):
    monkeypatch.setattr(shim, "ms_swift_installed", DETECT_MS_SWIFT)
    (tmp_path / "swift").mkdir()
    write(tmp_path, "swift/__init__.py", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not shim.ms_swift_installed()  # an unrelated package named swift
    (tmp_path / "swift" / "rewards").mkdir()
    assert shim.ms_swift_installed()


# ---------------------------------------------------------------------------------------------
# ms-swift's own example plugin (when its source is around; not in CI)


@pytest.fixture
def math_verify_or_fallback(monkeypatch):
    """Use math_verify when installed; else one whose parse fails, so the example reward falls
    back to comparing <answer> tags (the cases below score the same either way)."""
    if importlib.util.find_spec("math_verify") is None:
        def parse(text):
            raise ValueError("no math_verify here")

        stub = ModuleType("math_verify")
        stub.parse, stub.verify = parse, lambda gold, answer: False
        monkeypatch.setitem(sys.modules, "math_verify", stub)


@pytest.mark.skipif(not os.path.isfile(MS_SWIFT_PLUGIN),
                    reason="ms-swift's example plugin is absent")
def test_ms_swift_example_plugin(math_verify_or_fallback):
    modules = load_plugins([MS_SWIFT_PLUGIN])
    assert swift_modules() == {}
    assert {"external_countdown", "external_r1v_acc", "async_genrm"} <= set(registered_names())
    assert GYM_ENVS.names() == ["custom_env", "grid_world"]
    assert SCHEDULERS.names() == ["calculator", "gym_scheduler", "tool_call_scheduler"]
    funcs = resolve_reward_funcs(["external_countdown", "external_r1v_acc"], modules,
                                 RewardConfig(), init_kwargs={"args": SimpleNamespace()})
    countdown = compute_rewards(funcs[:1], [c[0] for c in COUNTDOWN_CASES],
                                target=[str(c[1]) for c in COUNTDOWN_CASES],
                                nums=[c[2] for c in COUNTDOWN_CASES])
    assert countdown == [[c[3] for c in COUNTDOWN_CASES]]
    r1v = compute_rewards(funcs[1:], [c[0] for c in R1V_CASES], solution=[c[1] for c in R1V_CASES])
    assert r1v == [[c[2] for c in R1V_CASES]]
