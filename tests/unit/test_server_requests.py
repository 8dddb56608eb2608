"""The rollout server's request checks (swift_megatron/rollout/requests.py), through its FastAPI
application over a stand-in replica: a value of the wrong type or text that is not valid Unicode
gets a 422 naming the field, never a 500 from deep inside the engine (issue 57). The same bodies
against a real vLLM server: tests/vllm/test_server.py's MALFORMED."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from swift_megatron.rollout.requests import text_problem  # noqa: E402
from swift_megatron.rollout.server import ServerState, build_app  # noqa: E402


class _Alive:
    def is_alive(self):
        return True


class EchoReplica:
    """Completes every prompt with its own first token; records the sampling it was sent."""

    index, process = 0, _Alive()

    def __init__(self):
        self.sampling = []

    def call(self, name, prompts, sampling, seeds, stop_token_ids, logprobs, images=None,
             routes=False):
        self.sampling.append(sampling)
        return [{"token_ids": p[:1], "logprobs": [-1.0], "finish_reason": "length"}
                for p in prompts]

    def exit_reason(self):
        return None


@pytest.fixture
def http():
    replica = EchoReplica()
    return TestClient(build_app(ServerState([replica], 1, 100, "127.0.0.1", "gloo"))), replica


def post(client, path, body):
    """A raw JSON body: json.dumps escapes a lone surrogate as JSON does ("\\ud800")."""
    return client.post(path, content=json.dumps(body),
                       headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("body,loc,message", [
    ({"prompts": [[1, 2]], "temperature": "0.5"}, ["body", "temperature"], "valid number"),
    ({"prompts": [[1, 2]], "top_p": "1"}, ["body", "top_p"], "valid number"),
    ({"prompts": [[1, 2]], "repetition_penalty": True}, ["body", "repetition_penalty"],
     "valid number"),
    ({"prompts": ["a\ud800b"]}, ["body", "prompts", "list[function-after[valid_text(), str]]",
                                 0], "the text holds a lone surrogate, '\\ud800', at character 1"),
])
def test_bad_values_are_422_naming_the_field(http, body, loc, message):
    """"temperature": "0.5" was taken as 0.5; a lone surrogate in a prompt reached the
    tokenizer (a 500 with its TypeError)."""
    client, _ = http
    answer = post(client, "/generate", body)
    assert answer.status_code == 422, answer.text
    assert any(d["loc"] == loc and message in d["msg"] for d in answer.json()["detail"]), \
        answer.json()


def test_a_surrogate_in_a_rollout_message_is_422_naming_it(http):
    client, _ = http
    body = {"prompts": [[1]], "max_length": 9, "messages": [
        [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\udc00"}]]}
    answer = post(client, "/rollout", body)
    assert answer.status_code == 422, answer.text
    [detail] = answer.json()["detail"]
    assert detail["loc"] == ["body", "messages", 0, 1]
    assert "['content'] holds a lone surrogate, '\\udc00', at character 1" in detail["msg"]


def test_an_image_that_is_not_base64_text_is_400(http):
    """Non-ASCII base64 raised a plain ValueError (a 500) in base64.b64decode."""
    client, _ = http
    for picture in ("caf\u00e9", "\ud800"):
        answer = post(client, "/generate", {"prompts": [[1, 2]], "images": [[picture]]})
        assert answer.status_code == 400 and "images[0]" in answer.text, answer.text


def test_numbers_given_as_integers_still_count(http):
    client, replica = http
    answer = post(client, "/generate", {"prompts": [[5, 6]], "temperature": 1, "top_p": 1,
                                        "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.json()["completions"][0]["token_ids"] == [5]
    assert replica.sampling[-1]["temperature"] == 1.0 and replica.sampling[-1]["top_p"] == 1.0


def test_text_problem_walks_keys_and_values():
    assert text_problem({"a": ["ok", {"b": "fine"}]}) is None
    assert text_problem({"a": ["ok", {"b": "\ud800"}]}) == (
        "['a'][1]['b'] holds a lone surrogate, '\\ud800', at character 0: not valid Unicode "
        "text")
    assert text_problem({"k\udfff": 1}).startswith("key 'k\\udfff' holds a lone surrogate")
