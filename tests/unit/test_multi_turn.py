"""Multi-turn rollouts (swift_megatron/rollout/multi_turn): the tokens appended between turns,
exact loss masks and logprobs of a hand-built two-turn conversation, the turn budget, the
built-in calculator scheduler and grid_world environment, metrics, and that tool/environment
tokens get no loss weight."""
import pytest
import torch

from swift_megatron.data import Prompt
from swift_megatron.errors import UserError
from swift_megatron.fixtures.tokenizer import load_tokenizer
from swift_megatron.rlhf.grpo.batch import Sample, collate
from swift_megatron.rlhf.grpo.losses import aggregate_loss, policy_loss
from swift_megatron.rollout.engine import Completion, SamplingConfig
from swift_megatron.rollout.multi_turn import (Episode, MultiTurnScheduler, MultiTurnSettings,
                                               Trajectory, Turn, build_scheduler,
                                               multi_turn_metrics, run_episodes)
from swift_megatron.rollout.multi_turn.builtin import (GridWorld, calculate, make_grid,
                                                       parse_action)
from swift_megatron.rollout.multi_turn.gym import gym_reward
from swift_megatron.rollout.multi_turn.tokens import turn_text

TOOL_TURN = "\n<|im_start|>tool\n<result>7</result><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


class ScriptedEngine:
    """Answers turn k of every request with the k-th scripted text (+ EOS), logprob -0.5 per
    token; records what it was asked."""

    def __init__(self, tok, script, eos=True):
        self.tok, self.script, self.eos = tok, script, eos
        self.calls = []
        self.weight_version = 3

    def generate(self, prompts, sampling, seeds=None):
        self.calls.append(([list(p) for p in prompts], list(seeds), sampling))
        turn = len(self.calls) - 1
        ids = self.tok(self.script[turn], add_special_tokens=False)["input_ids"]
        ids = ids + ([self.tok.convert_tokens_to_ids("<|im_end|>")] if self.eos else [])
        cut = ids[:sampling.max_tokens]
        reason = "stop" if len(cut) == len(ids) and self.eos else "length"
        return [Completion(list(cut), [-0.5] * len(cut), reason, self.weight_version)
                for _ in prompts]


def prompt_of(tok, text="What is 3 + 4?", columns=None):
    messages = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return Prompt(5, rendered, tok(rendered, add_special_tokens=False)["input_ids"], messages,
                  columns or {})


def settings(**overrides):
    values = dict(max_completion_length=64, max_length=512, max_turns=None)
    values.update(overrides)
    return MultiTurnSettings(**values)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tool_message_tokens_follow_the_template(tok):
    text = turn_text(tok, [{"role": "tool", "content": "<result>7</result>"}], "<|im_end|>")
    assert text == TOOL_TURN
    # an EOS the template does not use, or a turn cut without one: the template's own closing
    # is added
    hi = "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert turn_text(tok, [{"role": "user", "content": "hi"}], "<|endoftext|>") == hi
    assert turn_text(tok, [{"role": "user", "content": "hi"}], None) == hi
    with pytest.raises(UserError, match="string 'role' and 'content'"):
        turn_text(tok, [{"role": "tool", "content": 7}], "<|im_end|>")


# Qwen3's template in brief: tool results as user turns in <tool_response>, the reasoning block
# shown on the last assistant turn only, an empty one in the generation prompt without thinking
QWEN3_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_tool_tokens_with_a_template_that_renders_the_last_turn_differently(tok):
    import copy

    qwen3 = copy.deepcopy(tok)
    qwen3.chat_template = QWEN3_LIKE
    text = turn_text(qwen3, [{"role": "tool", "content": "<result>7</result>"}], "<|im_end|>",
                     {"enable_thinking": False})
    assert text == ("\n<|im_start|>user\n<tool_response>\n<result>7</result>\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    qwen3.chat_template = "{%- for m in messages if m.role != 'assistant' %}{{ m.content }}{% endfor %}"
    with pytest.raises(UserError, match="drops the assistant's earlier turns"):
        turn_text(qwen3, [{"role": "user", "content": "x"}], "<|im_end|>")


def test_calculator_two_turns_exact_tokens_masks_and_logprobs(tok):
    """Turn 1 calls the tool, turn 2 answers: the trajectory is exactly the engine's tokens,
    then the tool message's tokens (mask 0, logprob 0), then the engine's tokens; turn 2 was
    generated from prompt + turn 1 + tool tokens."""
    engine = ScriptedEngine(tok, ["<calculator>3 + 4</calculator>", "<answer>7</answer>"])
    scheduler = build_scheduler("calculator", max_turns=None, tokenizer=tok)
    prompt = prompt_of(tok)
    [trajectory] = run_episodes(engine, tok, scheduler, [prompt], SamplingConfig(max_tokens=64),
                                [11], settings())
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = ids(tok, "<calculator>3 + 4</calculator>") + [eos]
    tool = ids(tok, TOOL_TURN)
    turn2 = ids(tok, "<answer>7</answer>") + [eos]
    assert trajectory.token_ids == turn1 + tool + turn2
    assert trajectory.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert trajectory.logprobs == [-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)
    assert trajectory.turn_token_ids == [turn1, turn2]
    assert trajectory.prompt_ids == prompt.input_ids and trajectory.finish_reason == "stop"
    assert trajectory.weight_version == 3
    assert [call[0] for call in engine.calls] == [[prompt.input_ids],
                                                  [prompt.input_ids + turn1 + tool]]
    assert [call[1] for call in engine.calls][0] == [11]   # turn 1 keeps the request's seed
    assert engine.calls[1][1] != [11]
    # the whole sequence decodes to the chat the template would render (up to its final "\n")
    full = tok.decode(prompt.input_ids + trajectory.token_ids)
    assert full + "\n" == tok.apply_chat_template(trajectory.messages, tokenize=False)
    assert trajectory.messages[1:] == [
        {"role": "assistant", "content": "<calculator>3 + 4</calculator>"},
        {"role": "tool", "content": "<result>7</result>"},
        {"role": "assistant", "content": "<answer>7</answer>"}]
    assert trajectory.last_answer == "<answer>7</answer>"
    assert trajectory.rollout_infos == {"num_turns": 2, "step_rewards": [0.0, 0.0],
                                        "total_reward": 0.0, "tool_calls": 1, "tool_ok": True}


def test_tool_tokens_get_zero_loss_weight(tok):
    """collate turns loss_mask into completion_mask; the policy loss's gradient is exactly 0 at
    the tool tokens and not at the model's."""
    prompt_ids, completion = [1, 2, 3], [10, 11, 12, 13, 14, 15]
    mask = [1, 1, 0, 0, 0, 1]
    sample = Sample(0, 0, prompt_ids, completion, [-0.5] * 6, "stop", [1.0], reward=1.0,
                    advantage=1.0, loss_mask=mask)
    micro = collate([sample], pad_id=0)
    assert micro["completion_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 1]]
    truncated = Sample(0, 0, prompt_ids, completion, None, "length", [1.0], loss_mask=mask)
    assert collate([truncated], pad_id=0, overlong_filter=True)["completion_mask"].sum() == 0
    logprobs = torch.full((1, 8), -0.5, requires_grad=True)
    per_token, _ = policy_loss(logprobs, logprobs.detach(), micro["advantages"],
                               micro["completion_mask"], epsilon_low=0.2, epsilon_high=0.2)
    loss = aggregate_loss(per_token, micro["completion_mask"], "grpo", num_sequences=1,
                          num_tokens=3, max_completion_length=8, num_micro_batches=1)
    loss.backward()
    grad = logprobs.grad[0]
    assert grad.tolist() == pytest.approx([0, 0, -1 / 3, -1 / 3, 0, 0, 0, -1 / 3], abs=1e-7)


def test_max_turns_and_length_budget(tok):
    script = ["<calculator>1+1</calculator>"] * 3
    scheduler = build_scheduler("calculator", max_turns=2, tokenizer=tok)
    [t] = run_episodes(ScriptedEngine(tok, script), tok, scheduler, [prompt_of(tok)],
                       SamplingConfig(max_tokens=64), [0], settings(max_turns=2))
    assert t.rollout_infos["num_turns"] == 2 and t.loss_mask[-1] == 1  # ends on a model turn
    # total scope: the whole completion (tool tokens included) within max_completion_length
    first = len(ids(tok, "<calculator>1+1</calculator>")) + 1
    budget = first + len(ids(tok, TOOL_TURN.replace("7", "2"))) + 3
    [t] = run_episodes(ScriptedEngine(tok, script), tok, scheduler, [prompt_of(tok)],
                       SamplingConfig(max_tokens=64), [0],
                       settings(max_turns=2, limit_scope="total", max_completion_length=budget))
    assert len(t.token_ids) == budget and t.finish_reason == "length"
    assert t.loss_mask[-3:] == [1, 1, 1] and t.rollout_infos["num_turns"] == 2
    # max_length: no room for the model after the tool message -> cut before it
    prompt = prompt_of(tok)
    limit = len(prompt.input_ids) + first + 2
    [t] = run_episodes(ScriptedEngine(tok, script), tok, scheduler, [prompt],
                       SamplingConfig(max_tokens=64), [0], settings(max_length=limit))
    assert t.finish_reason == "length" and t.rollout_infos["num_turns"] == 1
    assert len(prompt.input_ids) + len(t.token_ids) <= limit


def test_truncated_turn_ends_the_episode_and_keep_going_is_asked(tok):
    engine = ScriptedEngine(tok, ["<calculator>1+1</calculator>"], eos=False)
    asked = []

    def keep_going(active):
        asked.append(active)
        return active > 0

    [t] = run_episodes(engine, tok, build_scheduler("calculator", max_turns=None, tokenizer=tok),
                       [prompt_of(tok)], SamplingConfig(max_tokens=64), [0], settings(),
                       keep_going=keep_going)
    assert t.finish_reason == "length" and t.truncated and set(t.loss_mask) == {1}
    assert asked == [1, 0]


def test_calculator_evaluates_arithmetic_only():
    assert calculate("2 ** 10 - (3 * 4) / 8") == pytest.approx(1022.5)
    assert calculate("-7 // 2") == -4
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "1 / 0", "[1]", "((10**60)**60)**60",
                "1e300 * 1e300", "(-8) ** 0.5", "True + 1"):
        with pytest.raises(ValueError):
            calculate(bad)
    scheduler = build_scheduler("calculator", max_turns=None, tokenizer=None)
    episode = Episode([{"role": "user", "content": "q"}])
    assert scheduler.step(episode, "no tool here", 1).done
    answer = scheduler.step(episode, "<calculator>1/0</calculator>", 1)
    assert answer.messages == [{"role": "tool", "content": "<error>division by zero</error>"}]
    assert answer.info == {"tool_ok": False}


def test_grid_world_rewards_and_rendering():
    grid = make_grid(4, 0.3, seed=1)
    assert grid[0][0] == "S" and grid[3][3] == "G" and len(grid) == 4
    assert make_grid(4, 0.3, seed=1) == grid      # the seed fixes the map
    env = GridWorld({"size": 3, "holes": 0.0, "seed": 0})
    observation, info, system = env.reset(Episode([], prompt_id=9))
    assert observation == "PFF\nFFF\nFFG" and info == {"seed": 0} and "<action>" in system
    say = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert env.step(say("hmm"))[1:3] == (0.0, False)
    assert env.step(say("<action>up</action>"))[0].endswith("PFF\nFFF\nFFG")  # wall: stays
    assert env.step(say("<action>down</action>"))[1:3] == (0.0, False)
    env.step(say("<action>down</action>"))
    env.step(say("<action>right</action>"))
    observation, reward, done, info = env.step(say("<action>RIGHT</action>"))
    assert (reward, done, info) == (1.0, True, {"status": "goal"})
    env.grid = ["SH", "FG"]
    env.position = (0, 0)
    assert env.step(say("<action>right</action>"))[1:4] == (0.0, True, {"status": "hole"})
    assert parse_action("<action>left</action> then <action> up </action>") == "up"


def test_gym_scheduler_episode_rewards(tok):
    """gym_scheduler + grid_world: the prompt is the environment's (system + map), each turn's
    reward is the environment's, the episode's total is gym_reward."""
    engine = ScriptedEngine(tok, ["<action>down</action>", "<action>right</action>"])
    scheduler = build_scheduler("gym_scheduler", max_turns=5, tokenizer=tok)
    scheduler.gym_env = "grid_world"
    prompt = prompt_of(tok, "<placeholder>", {"env_config": {"size": 2, "holes": 0.0}})
    [t] = run_episodes(engine, tok, scheduler, [prompt], SamplingConfig(max_tokens=32), [0],
                       settings(max_turns=5))
    assert t.messages[0]["role"] == "system" and t.messages[1]["content"] == "PF\nFG"
    assert t.prompt_ids == tok(tok.apply_chat_template(t.messages[:2], tokenize=False,
                                                       add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"]
    assert engine.calls[0][0] == [t.prompt_ids]
    assert t.rollout_infos["step_rewards"] == [0.0, 1.0] and t.rollout_infos["status"] == "goal"
    assert gym_reward(["x"], [t.rollout_infos]) == [1.0]
    # the final observation is not appended: the trajectory ends with the model's turn
    assert t.messages[-1] == {"role": "assistant", "content": "<action>right</action>"}


def test_gym_scheduler_needs_an_environment(tok):
    scheduler = build_scheduler("gym_scheduler", max_turns=None, tokenizer=tok)
    with pytest.raises(UserError, match="names no environment: pass --gym_env"):
        run_episodes(ScriptedEngine(tok, ["x"]), tok, scheduler, [prompt_of(tok)],
                     SamplingConfig(max_tokens=8), [0], settings())
    scheduler.gym_env = "grid_wrld"
    with pytest.raises(UserError, match="Did you mean 'grid_world'"):
        run_episodes(ScriptedEngine(tok, ["x"]), tok, scheduler, [prompt_of(tok)],
                     SamplingConfig(max_tokens=8), [0], settings())


def test_scheduler_must_return_a_turn(tok):
    class Bad(MultiTurnScheduler):
        def step(self, episode, completion, turn):
            return {"role": "user", "content": "x"}

    with pytest.raises(UserError, match="Bad.step must return a Turn, got dict"):
        run_episodes(ScriptedEngine(tok, ["x"]), tok, Bad(), [prompt_of(tok)],
                     SamplingConfig(max_tokens=8), [0], settings())


def test_multi_turn_metrics():
    infos = [{"num_turns": 1, "step_rewards": [0.5], "total_reward": 0.5},
             {"num_turns": 3, "step_rewards": [0.0, 0.0, 1.0], "total_reward": 1.0}]
    metrics = multi_turn_metrics(infos, env_tokens=[0, 10], model_tokens=[4, 8])
    assert metrics == pytest.approx({
        "multi_turn/num_turns_mean": 2.0, "multi_turn/num_turns_max": 3.0,
        "multi_turn/episode_reward_mean": 0.75, "multi_turn/env_tokens_mean": 5.0,
        "multi_turn/model_tokens_mean": 6.0, "multi_turn/turn_1_reward_mean": 0.25,
        "multi_turn/turn_2_reward_mean": 0.0, "multi_turn/turn_3_reward_mean": 1.0})
    assert multi_turn_metrics([], [], []) == {}


def test_trajectory_is_a_completion():
    t = Trajectory([1, 2], None, "length", 0, loss_mask=[1, 0])
    assert isinstance(t, Completion) and t.truncated and t.last_answer == ""
    assert Turn(message={"role": "user", "content": "x"}).messages == \
        [{"role": "user", "content": "x"}]


def test_collector_scores_the_last_answer_and_logs_turn_metrics(tok, single_process_group):
    """The collector with a scheduler: samples carry the trajectory's tokens and loss mask,
    reward functions see the last answer, the whole chat and rollout_infos; gym_reward adds the
    episode total; multi_turn/ metrics count turns and tokens."""
    from swift_megatron.rlhf.grpo.collect import CollectSettings, RolloutCollector

    seen = {}

    def exact(completions, messages, rollout_infos, **kwargs):
        seen.update(completions=completions, messages=messages, infos=rollout_infos)
        return [float(c == "<answer>7</answer>") for c in completions]

    class Scored(MultiTurnScheduler):   # turn 1 earns 0.25, then the episode stops
        def step(self, episode, completion, turn):
            if turn == 1:
                return Turn(message={"role": "tool", "content": "<result>7</result>"}, reward=0.25)
            return Turn(done=True, reward=0.5)

    engine = ScriptedEngine(tok, ["<calculator>3 + 4</calculator>", "<answer>7</answer>"])
    sampling = SamplingConfig(max_tokens=32)
    collect_settings = CollectSettings(
        num_generations=2, sampling=sampling, reward_names=["exact", "gym_reward"],
        reward_weights=[1.0, 2.0], scale_rewards="group", dynamic_sample=False,
        max_resample_times=0, multi_turn=settings(max_turns=3))
    group = single_process_group
    collector = RolloutCollector(engine, [("exact", exact), ("gym_reward", gym_reward)], tok,
                                 collect_settings, group, group, lambda n: [],
                                 torch.device("cpu"), scheduler=Scored())
    prompt = prompt_of(tok)
    samples, metrics = collector.collect([prompt], [0], seed=1)
    assert len(samples) == 2 and len(engine.calls) == 2
    s = samples[0]
    tool = ids(tok, TOOL_TURN)
    assert s.loss_mask.count(0) == len(tool) and s.prompt_ids == prompt.input_ids
    assert s.rewards == [1.0, 0.75] and s.reward == pytest.approx(1.0 + 2 * 0.75)
    assert seen["completions"] == ["<answer>7</answer>"] * 2
    assert [m["role"] for m in seen["messages"][0]] == ["user", "assistant", "tool", "assistant"]
    assert seen["infos"][0]["step_rewards"] == [0.25, 0.5]
    assert s.completion_text.startswith("<calculator>3 + 4</calculator>")
    assert metrics["multi_turn/num_turns_mean"] == 2.0
    assert metrics["multi_turn/turn_1_reward_mean"] == 0.25
    assert metrics["multi_turn/episode_reward_mean"] == 0.75
    assert metrics["multi_turn/env_tokens_mean"] == len(tool)


# ---- ms-swift plugins (compat/ms_swift/scheduler.py) -----------------------------------------

MS_SWIFT_PLUGIN = '''
from swift.rollout.gym_env import Env, envs
from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns


class ToolCall(MultiTurnScheduler):
    def check_finished(self, infer_request, response_choice, current_turn):
        if "<calculator>" not in response_choice.message.content:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "tool", "content": "<result>7</result>"})
        return {"infer_request": infer_request,
                "rollout_infos": {"total_reward": 0.5 * current_turn,
                                  "seen": response_choice.finish_reason}}


class Rewriter(ToolCall):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]["content"] += " wait"
        return {"infer_request": infer_request}


class Runner(MultiTurnScheduler):
    async def run(self, infer_request, request_config, **kwargs):
        return None


class Counter(Env):
    async def reset(self, config):
        self.steps = 0
        return f"start {config.data_dict['env_config']['k']}", {"k": 1}, "be brief"

    async def step(self, action):
        self.steps += 1
        return f"step {self.steps}", 0.25, self.steps >= 2, {"last": action[-1]["content"]}

    async def close(self):
        pass


multi_turns["ms_tool_call"] = ToolCall
multi_turns["ms_rewriter"] = Rewriter
multi_turns["ms_runner"] = Runner
envs["ms_counter"] = Counter
'''


@pytest.fixture
def ms_swift_plugin(tmp_path):
    import swift_megatron.compat.ms_swift  # noqa: F401  (ms-swift plugin files load)
    from swift_megatron.rewards import load_plugins
    from swift_megatron.rollout.plugin_registry import GYM_ENVS, SCHEDULERS

    saved = [(r, dict(r._classes), dict(r._sources)) for r in (GYM_ENVS, SCHEDULERS)]
    path = tmp_path / "ms_plugin.py"
    path.write_text(MS_SWIFT_PLUGIN)
    load_plugins([str(path)])
    yield
    for registry, classes, sources in saved:
        registry._classes, registry._sources = classes, sources


def test_ms_swift_scheduler_runs_through_its_hooks(tok, ms_swift_plugin):
    engine = ScriptedEngine(tok, ["<calculator>3 + 4</calculator>", "<answer>7</answer>"])
    scheduler = build_scheduler("ms_tool_call", max_turns=4, tokenizer=tok)
    assert scheduler.inner.max_turns == 4 and scheduler.inner.tokenizer is tok
    [t] = run_episodes(engine, tok, scheduler, [prompt_of(tok)], SamplingConfig(max_tokens=64),
                       [0], settings(max_turns=4))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turn1, turn2 = ids(tok, "<calculator>3 + 4</calculator>") + [eos], ids(tok, "<answer>7</answer>") + [eos]
    tool = ids(tok, TOOL_TURN)
    assert t.token_ids == turn1 + tool + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    # total_reward 0.5 after turn 1, then the episode stops (check_finished): turn rewards
    assert t.rollout_infos["step_rewards"] == [0.5, 0.0] and t.rollout_infos["total_reward"] == 0.5
    assert t.rollout_infos["seen"] == "stop"


def test_ms_swift_env_with_gym_scheduler(tok, ms_swift_plugin):
    engine = ScriptedEngine(tok, ["a", "b", "c"])
    scheduler = build_scheduler("gym_scheduler", max_turns=None, tokenizer=tok)
    prompt = prompt_of(tok, "<placeholder>", {"env_config": {"name": "ms_counter", "k": 3}})
    [t] = run_episodes(engine, tok, scheduler, [prompt], SamplingConfig(max_tokens=8), [0],
                       settings())
    assert [m["content"] for m in t.messages] == ["be brief", "start 3", "a", "step 1", "b"]
    assert t.rollout_infos["step_rewards"] == [0.25, 0.25] and t.rollout_infos["last"] == "b"
    assert t.rollout_infos["k"] == 1 and len(engine.calls) == 2


def test_ms_swift_schedulers_that_rewrite_or_run_are_refused(tok, ms_swift_plugin):
    with pytest.raises(UserError, match="Runner overrides run"):
        build_scheduler("ms_runner", max_turns=None, tokenizer=tok)
    rewriter = build_scheduler("ms_rewriter", max_turns=None, tokenizer=tok)
    with pytest.raises(UserError, match="Rewriter.step changed earlier messages"):
        run_episodes(ScriptedEngine(tok, ["<calculator>1</calculator>"]), tok, rewriter,
                     [prompt_of(tok)], SamplingConfig(max_tokens=64), [0], settings())


def test_turns_cut_at_the_limit_can_continue(tok):
    """stop_when_truncated = False: a turn without EOS gets the template's closing tokens
    (masked) before the tool message."""
    class Continue(MultiTurnScheduler):
        stop_when_truncated = False

        def step(self, episode, completion, turn):
            assert episode.finish_reason == "length"
            return Turn(done=turn == 2, message={"role": "tool", "content": "<result>7</result>"})

    # the cut turn's last token "l" also occurs in the tool message: it must not be taken for
    # the end of the turn
    engine = ScriptedEngine(tok, ["x\ntool", "def"], eos=False)
    [t] = run_episodes(engine, tok, Continue(), [prompt_of(tok)], SamplingConfig(max_tokens=64),
                       [0], settings())
    closing = ids(tok, "<|im_end|>" + TOOL_TURN)
    first = ids(tok, "x\ntool")
    assert t.token_ids == first + closing + ids(tok, "def")
    assert t.loss_mask == [1] * len(first) + [0] * len(closing) + [1] * len(ids(tok, "def"))
