"""--agent_template hermes (data/agent.py), as ms-swift's hermes agent template writes it: a row's
tools in the system prompt, a multi-turn scheduler's tool results as one user turn of
<tool_response> blocks (whatever the chat template does with a tool role), the tool-call
parser; without the flag the tools are not rendered and tool messages use the template's tool
role; ms-swift's ReAct templates and unknown names are refused with the supported ones."""
import json

import pytest

from swift_megatron.arguments.commands import RlhfArguments, RolloutCommandArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.data import agent
from swift_megatron.data.prompts import PromptSettings, build_prompts
from swift_megatron.errors import UserError
from swift_megatron.fixtures.tokenizer import load_tokenizer
from swift_megatron.rollout.engine import SamplingConfig
from swift_megatron.rollout.multi_turn import build_scheduler, run_episodes
from tests.unit.test_multi_turn import ScriptedEngine, ids, prompt_of, settings

WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_hermes_system_prompt_is_ms_swifts():
    text = agent.hermes_system("Be brief.", [WEATHER])
    schema = json.dumps({"type": "function", "function": WEATHER})
    assert text == (
        "Be brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schema}\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def test_a_rows_tools_join_its_system_prompt(tok):
    rows = [{"query": "Weather in Paris?", "tools": json.dumps([WEATHER])},
            {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi"}], "tools": [WEATHER]},
            {"query": "No tools here"}]
    hermes = build_prompts(rows, tok, PromptSettings(512, agent_template="hermes"))
    plain = build_prompts(rows, tok, PromptSettings(512))
    assert hermes[0].messages[0] == {"role": "system", "content": agent.hermes_system(None, [WEATHER])}
    assert hermes[1].messages[0]["content"] == agent.hermes_system("Be brief.", [WEATHER])
    assert "<tools>" in hermes[0].text and "<tools>" not in plain[0].text
    assert hermes[2].text == plain[2].text
    assert hermes[0].columns["tools"] == rows[0]["tools"]   # still a column for the rewards
    with pytest.raises(UserError, match=r"row 1: 'tools' must be a list of function schemas"):
        build_prompts([{"query": "q", "tools": "{}"}], tok, PromptSettings(512, agent_template="hermes"))


def test_tool_results_become_one_user_turn_of_tool_responses():
    messages = [{"role": "tool", "content": "7"}, {"role": "tool", "content": "8"},
                {"role": "user", "content": "go on"}]
    assert agent.tool_results(messages) == [
        {"role": "user", "content": "<tool_response>\n7\n</tool_response>\n"
                                    "<tool_response>\n8\n</tool_response>"},
        {"role": "user", "content": "go on"}]


def test_tool_calls_are_parsed():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>not json</tool_call><tool_call>{"name": "x"}</tool_call>')
    assert agent.tool_calls(text) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_multi_turn_tool_results_in_hermes_form(tok):
    """The calculator's tool message reaches the model as hermes' user turn, not the fixture
    template's tool role; without the flag, the tool role."""
    script = ["<calculator>3 + 4</calculator>", "<answer>7</answer>"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = ids(tok, script[0]) + [eos]
    results = {}
    for name in (None, "hermes"):
        scheduler = build_scheduler("calculator", max_turns=None, tokenizer=tok)
        [trajectory] = run_episodes(ScriptedEngine(tok, script), tok, scheduler, [prompt_of(tok)],
                                    SamplingConfig(max_tokens=64), [1],
                                    settings(agent_template=name))
        results[name] = tok.decode(trajectory.token_ids[len(turn1):trajectory.loss_mask.index(
            1, len(turn1))])
        assert trajectory.messages[2] == {"role": "tool", "content": "<result>7</result>"}
    assert results[None] == "\n<|im_start|>tool\n<result>7</result><|im_end|>\n<|im_start|>assistant\n"
    assert results["hermes"] == ("\n<|im_start|>user\n<tool_response>\n<result>7</result>\n"
                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("name, message", [
    ("react_en", r"--agent_template react_en: ms-swift's ReAct templates continue the "
                 r"assistant's turn after the stop word 'Observation:'.*supported: hermes"),
    ("glm4", r"--agent_template glm4: not supported; supported: hermes"),
])
def test_other_templates_are_refused(name, message):
    with pytest.raises(UserError, match=message):
        parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--agent_template", name],
                      "megatron rlhf")
    with pytest.raises(UserError, match=message):
        parse_command(RolloutCommandArguments, ["--model", "m", "--agent_template", name],
                      "megatron rollout")
