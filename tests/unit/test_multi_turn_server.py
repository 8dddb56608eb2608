"""`megatron rollout --multi_turn_scheduler`: the server's /rollout endpoint runs whole
multi-turn episodes over its replicas (here a scripted stand-in for the vLLM replica processes)
and returns trajectories with the exact token ids, loss masks and rollout_infos; /health names
the scheduler; bad requests get a 4xx; the flags are checked."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from swift_megatron.arguments.commands import RolloutCommandArguments  # noqa: E402
from swift_megatron.arguments.parser import parse_command  # noqa: E402
from swift_megatron.errors import UserError  # noqa: E402
from swift_megatron.fixtures.tokenizer import load_tokenizer  # noqa: E402
from swift_megatron.rollout.multi_turn import (MultiTurnScheduler,  # noqa: E402
                                               build_scheduler)
from swift_megatron.rollout.server import MultiTurnService, ServerState, build_app  # noqa: E402

TOOL_TURN = "\n<|im_start|>tool\n<result>7</result><|im_end|>\n<|im_start|>assistant\n"


class _Alive:
    def is_alive(self):
        return True


class ScriptedReplica:
    """Answers the k-th generate command with script[k] (+ EOS) for every prompt."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []
        self.process, self.index = _Alive(), 0

    def call(self, name, prompts, sampling, seeds, stop_token_ids, logprobs, images=None,
             routes=False):
        assert name == "generate" and images is None   # multi-turn rollouts carry no images
        self.calls.append(prompts)
        ids = self.tok(self.script[len(self.calls) - 1], add_special_tokens=False)["input_ids"]
        ids = ids + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return [{"token_ids": ids, "logprobs": [-0.25] * len(ids), "finish_reason": "stop"}
                for _ in prompts]

    def exit_reason(self):
        return None   # a running replica (rollout/replicas.py)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def client(tok, script, scheduler=None):
    replica = ScriptedReplica(tok, script)
    service = None if scheduler is None else MultiTurnService("calculator", scheduler, tok, 3)
    state = ServerState([replica], 1, len(tok), "127.0.0.1", "gloo", multi_turn=service)
    return TestClient(build_app(state)), replica


def request_for(tok, **extra):
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = dict(prompts=[tok(text, add_special_tokens=False)["input_ids"]], messages=[messages],
                columns=[{"solution": "7"}], row_ids=[4], seeds=[9], max_tokens=32,
                max_length=256, stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    body.update(extra)
    return body


def test_rollout_runs_the_servers_scheduler(tok):
    http, replica = client(tok, ["<calculator>3 + 4</calculator>", "<answer>7</answer>"],
                           build_scheduler("calculator", max_turns=3, tokenizer=tok))
    assert http.get("/health").json()["multi_turn_scheduler"] == "calculator"
    body = request_for(tok)
    answer = http.post("/rollout", json=body)
    assert answer.status_code == 200, answer.text
    [t] = answer.json()["trajectories"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = tok("<calculator>3 + 4</calculator>", add_special_tokens=False)["input_ids"] + [eos]
    tool = tok(TOOL_TURN, add_special_tokens=False)["input_ids"]
    turn2 = tok("<answer>7</answer>", add_special_tokens=False)["input_ids"] + [eos]
    assert t["token_ids"] == turn1 + tool + turn2
    assert t["loss_mask"] == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert t["logprobs"] == [-0.25] * len(turn1) + [0.0] * len(tool) + [-0.25] * len(turn2)
    assert t["prompt_ids"] == body["prompts"][0] and t["finish_reason"] == "stop"
    assert t["rollout_infos"]["num_turns"] == 2 and t["messages"][-1]["content"] == "<answer>7</answer>"
    assert replica.calls == [body["prompts"], [body["prompts"][0] + turn1 + tool]]


def test_rollout_errors(tok):
    class Bad(MultiTurnScheduler):
        def step(self, episode, completion, turn):
            return "not a turn"

    plain, _ = client(tok, ["x"])
    assert plain.get("/health").json()["multi_turn_scheduler"] is None
    refused = plain.post("/rollout", json=request_for(tok))
    assert refused.status_code == 409 and "--multi_turn_scheduler" in refused.text
    http, _ = client(tok, ["x", "y"], Bad())
    mismatch = http.post("/rollout", json=request_for(tok, row_ids=[1, 2]))
    assert mismatch.status_code == 400 and "differ in length" in mismatch.text
    bad = http.post("/rollout", json=request_for(tok))
    assert bad.status_code == 400 and "Bad.step must return a Turn" in bad.text
    assert http.post("/rollout", json=request_for(tok, max_length=1)).status_code == 422


def test_server_multi_turn_flags():
    def parse(*argv):
        return parse_command(RolloutCommandArguments, ["--model", "m", *map(str, argv)],
                             "megatron rollout")

    args = parse("--multi_turn_scheduler", "gym_scheduler", "--gym_env", "grid_world",
                 "--max_turns", 4, "--external_plugins", "a.py")
    m = args.multi_turn
    assert (m.multi_turn_scheduler, m.gym_env, m.max_turns, m.external_plugins) == \
        ("gym_scheduler", "grid_world", 4, ["a.py"])
    from swift_megatron.compat.ms_swift import flat_args

    gym = build_scheduler("gym_scheduler", max_turns=4, tokenizer=None, args=flat_args(args))
    assert gym.gym_env == "grid_world"   # the server's --gym_env reaches the scheduler
    with pytest.raises(UserError, match="--max_turns applies to multi-turn rollouts"):
        parse("--max_turns", 2)
    with pytest.raises(UserError, match="--max_turns must be >= 1"):
        parse("--multi_turn_scheduler", "calculator", "--max_turns", 0)


def test_server_reward_and_template_flags():
    """frozen_lake_server.sh's server flags: --use_gym_env (default: with --gym_env),
    --enable_thinking and --max_length, each meaningful with a scheduler only."""
    def parse(*argv):
        return parse_command(RolloutCommandArguments, ["--model", "m", *map(str, argv)],
                             "megatron rollout").multi_turn

    lake = parse("--multi_turn_scheduler", "gym_scheduler", "--gym_env", "frozen_lake",
                 "--enable_thinking", "false", "--max_length", 6120)
    assert (lake.use_gym_env, lake.enable_thinking, lake.max_length) == (True, False, 6120)
    assert parse("--multi_turn_scheduler", "calculator").use_gym_env is False
    assert parse("--multi_turn_scheduler", "gym_scheduler", "--gym_env", "frozen_lake",
                 "--use_gym_env", "false").use_gym_env is False
    for flags in (["--use_gym_env", "true"], ["--enable_thinking", "true"],
                  ["--max_length", 100]):
        with pytest.raises(UserError, match=f"{flags[0]} applies to multi-turn rollouts"):
            parse(*flags)
    with pytest.raises(UserError, match="--max_length must be >= 2"):
        parse("--multi_turn_scheduler", "calculator", "--max_length", 1)


def test_trainer_takes_the_servers_gym_reward():
    """Server mode: without --reward_funcs the reward check waits for the servers' /health; a
    server's --use_gym_env then adds gym_reward unless the trainer set --use_gym_env itself;
    --async_generate with the servers' scheduler is refused."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.preflight import check_reward_sources
    from swift_megatron.rlhf.grpo.components import (adopt_server_gym_reward,
                                                     check_multi_turn_sources)

    def rlhf(*argv):
        return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *argv],
                             "megatron rlhf")

    server = rlhf("--vllm_mode", "server")
    check_reward_sources(server)   # the servers may supply it: asked later
    with pytest.raises(UserError, match="the rollout servers supply no reward"):
        check_reward_sources(server, servers_asked=True)
    adopt_server_gym_reward(server, True)
    assert server.grpo.use_gym_env is True
    check_reward_sources(server, servers_asked=True)
    off = rlhf("--vllm_mode", "server", "--use_gym_env", "false")
    adopt_server_gym_reward(off, True)
    assert off.grpo.use_gym_env is False
    with pytest.raises(UserError, match="--reward_funcs is required"):
        check_reward_sources(off)
    with pytest.raises(UserError, match="--reward_funcs is required"):
        check_reward_sources(rlhf())   # colocate: nothing to wait for
    asynchronous = rlhf("--vllm_mode", "server", "--async_generate", "true")
    check_multi_turn_sources(asynchronous, None)
    with pytest.raises(UserError, match="--async_generate true does not support multi-turn "
                                        "rollouts, and the rollout servers run the scheduler "
                                        "gym_scheduler"):
        check_multi_turn_sources(asynchronous, "gym_scheduler")
