"""--agent_template: how a row's tools reach the prompt, and how tool results are written back
between the turns of a multi-turn rollout, as ms-swift's agent templates write them.

- none (the default): the dataset's `tools` column is not rendered (a column for the reward
  functions, like any other); a scheduler's `tool` messages go through the chat template's own
  tool role (Qwen2.5's and Qwen3's templates write hermes' `<tool_response>` user turn).
- `hermes` (ms-swift's hermes template): a row's `tools` (a list of function schemas, or its
  JSON text) are appended to the system prompt in hermes' words (`# Tools`, the schemas in
  `<tools></tools>`, calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`); the
  tool messages after a model turn become one user turn of `<tool_response>` blocks, whatever
  the model's chat template does with a tool role. `tool_calls(text)` parses the calls.

The names are checked with the flags (arguments/data.py `check_agent_template`: ms-swift's ReAct
templates continue the assistant's own turn after an `Observation:` stop word, which needs
generation stop strings, not supported here).
"""
import json
from typing import Any, Dict, List, Optional, Sequence

Message = Dict[str, Any]
_CALL_START, _CALL_END = "<tool_call>", "</tool_call>"


def parse_tools(value: Any) -> List[dict]:
    """A row's `tools`: a list of function schemas, or its JSON text; ValueError otherwise."""
    tools = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"'tools' must be a list of function schemas (or its JSON), got "
                         f"{type(tools).__name__}")
    return tools


def _wrapped(tool: dict) -> dict:
    """{"type": "function", "function": schema}, as hermes lists a tool."""
    return tool if "type" in tool or "function" in tool else {"type": "function", "function": tool}


def hermes_system(system: Optional[str], tools: Sequence[dict]) -> str:
    """The system prompt with the tools in hermes' words (ms-swift's HermesAgentTemplate)."""
    schemas = "\n".join(json.dumps(_wrapped(tool), ensure_ascii=False) for tool in tools)
    return (f"{system or ''}\n\n# Tools\n\nYou may call one or more functions to assist with the "
            "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
            f"tags:\n<tools>\n{schemas}\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n"
            f"{_CALL_START}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
            f"{_CALL_END}")


def with_tools(messages: List[Message], tools: Sequence[dict]) -> List[Message]:
    """`messages` with the tools in the system message (one is added when there is none)."""
    if messages and messages[0]["role"] == "system":
        return [dict(messages[0], content=hermes_system(messages[0]["content"], tools)),
                *messages[1:]]
    return [{"role": "system", "content": hermes_system(None, tools)}, *messages]


def tool_results(messages: Sequence[Message]) -> List[Message]:
    """A scheduler's messages with each run of `tool` messages as one user turn of hermes'
    `<tool_response>` blocks."""
    out: List[Message] = []
    for message in messages:
        if message.get("role") != "tool":
            out.append(dict(message))
            continue
        block = f"<tool_response>\n{message['content']}\n</tool_response>"
        if out and out[-1].get("tool_responses"):
            out[-1]["content"] += "\n" + block
        else:
            out.append({"role": "user", "content": block, "tool_responses": True})
    return [{k: v for k, v in m.items() if k != "tool_responses"} for m in out]


def tool_calls(text: str) -> List[dict]:
    """The `<tool_call>{"name", "arguments"}</tool_call>` calls of a model turn, in order; a
    block that is not such a JSON object is skipped (as ms-swift's parser does)."""
    calls = []
    for part in text.split(_CALL_START)[1:]:
        body = part.split(_CALL_END, 1)[0] if _CALL_END in part else None
        try:
            call = json.loads(body) if body is not None else None
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and "name" in call and "arguments" in call:
            calls.append({"name": call["name"], "arguments": call["arguments"]})
    return calls
