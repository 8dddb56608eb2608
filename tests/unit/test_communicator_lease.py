"""The rollout server's weight-sync communicator: one owner at a time on a lease
(rollout/server.py). /init_communicator only reserves it (the replicas, here stand-ins, see
nothing until /join_communicator), a second client gets 409 with Retry-After while the lease
runs, the owner's requests renew it, and a lapsed lease frees the communicator (the replicas
close their side) so that the next client gets it. The trainer's side (rollout/client.py)
gives back what it opened, a reservation it was still joining included. Also the multi-turn
service's server-side defaults (--enable_thinking, --max_length) reaching each /rollout
request."""
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from swift_megatron.rollout import server  # noqa: E402
from swift_megatron.rollout.server import MultiTurnService, ServerState, build_app  # noqa: E402

LEASE_S = 0.4


class Replica:
    """Records the commands the HTTP process sends it; every command succeeds at once."""

    def __init__(self, index):
        self.index, self.commands = index, []

    def submit(self, name, on_done, **kwargs):
        self.commands.append(name)
        on_done(None)

    def call(self, name, **kwargs):
        self.commands.append(name)

    def exit_reason(self):
        return None


def serve(multi_turn=None):
    replicas = [Replica(0), Replica(1)]
    state = ServerState(replicas, 1, 100, "127.0.0.1", "gloo", communicator_lease=LEASE_S,
                        multi_turn=multi_turn)
    return TestClient(build_app(state)), replicas


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_reservation_touches_no_replica_and_lapses():
    http, replicas = serve()
    first = http.post("/init_communicator", json={}).json()
    assert (first["world_size"], first["client_rank"], first["lease_s"]) == (3, 2, LEASE_S)
    assert all(r.commands == [] for r in replicas)   # generation never waits on it
    busy = http.post("/init_communicator", json={})
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert "lease lapses within 1 s" in busy.json()["detail"]
    assert http.get("/health").json()["communicator"]["joined"] is False
    time.sleep(LEASE_S + 0.1)
    assert http.get("/health").json()["communicator"] is None
    second = http.post("/init_communicator", json={}).json()
    assert second["token"] != first["token"]
    late = http.post("/join_communicator", json={"token": first["token"]})
    assert late.status_code == 403 and "another client" in late.json()["detail"]
    assert all(r.commands == [] for r in replicas)   # nothing was joined: nothing to close


def test_the_owner_joins_renews_and_closes():
    http, replicas = serve()
    token = http.post("/init_communicator", json={}).json()["token"]
    bucket = {"token": token, "names": ["w"], "dtypes": ["float32"], "shapes": [[2]],
              "last": True}
    early = http.post("/update_weights", json=bucket)
    assert early.status_code == 409 and "/join_communicator first" in early.json()["detail"]
    assert http.post("/join_communicator", json={"token": token}).json() == {"status": "ok"}
    assert [r.commands for r in replicas] == [["open_communicator"]] * 2
    again = http.post("/join_communicator", json={"token": token})
    assert again.status_code == 409
    for _ in range(4):   # 4 x 0.6 lease: alive only because each heartbeat renews it
        time.sleep(0.6 * LEASE_S)
        beat = http.post("/communicator_heartbeat", json={"token": token})
        assert beat.json() == {"status": "ok", "lease_s": LEASE_S}
    assert http.post("/update_weights", json=bucket).status_code == 200
    assert http.get("/health").json()["weight_version"] == 1
    assert http.post("/close_communicator", json={"token": token}).json() == {"status": "ok"}
    wait_for(lambda: all(r.commands[-1] == "close_communicator" for r in replicas))
    assert http.get("/health").json()["communicator"] is None
    assert http.post("/close_communicator", json={"token": token}).json() == {"status": "ok"}


def test_a_lapsed_owner_is_freed_and_its_requests_refused():
    http, replicas = serve()
    token = http.post("/init_communicator", json={}).json()["token"]
    http.post("/join_communicator", json={"token": token})
    time.sleep(LEASE_S + 0.1)   # the trainer died: no heartbeat
    beat = http.post("/communicator_heartbeat", json={"token": token})
    assert beat.status_code == 409 and "lease lapsed" in beat.json()["detail"]
    wait_for(lambda: all(r.commands == ["open_communicator", "close_communicator"]
                         for r in replicas))
    assert http.post("/init_communicator", json={}).status_code == 200


def test_server_defaults_reach_each_rollout(monkeypatch):
    """--enable_thinking is the template's default (the request's value wins) and --max_length
    caps the request's; /health says whether the server supplies the gym reward."""
    seen = {}

    def run_episodes(engine, tokenizer, scheduler, prompts, sampling, seeds, settings):
        seen["settings"] = settings
        return []

    monkeypatch.setattr("swift_megatron.rollout.multi_turn.run_episodes", run_episodes)
    service = MultiTurnService("gym_scheduler", None, None, 3, use_gym_env=True, max_length=50,
                               template_kwargs={"enable_thinking": False})
    http, _ = serve(service)
    assert http.get("/health").json()["use_gym_env"] is True
    body = dict(prompts=[[1, 2]], messages=[[{"role": "user", "content": "x"}]], max_tokens=4)
    assert http.post("/rollout", json=dict(body, max_length=80)).status_code == 200
    settings = seen["settings"]
    assert (settings.max_length, settings.template_kwargs) == (50, {"enable_thinking": False})
    http.post("/rollout", json=dict(body, max_length=30,
                                    template_kwargs={"enable_thinking": True}))
    settings = seen["settings"]
    assert (settings.max_length, settings.template_kwargs) == (30, {"enable_thinking": True})
    assert server.MultiTurnService("x", None, None, None).use_gym_env is False


class Conn:
    """A stand-in ServerConnection: answers /init_communicator with `answers` in turn."""

    def __init__(self, answers=()):
        self.answers, self.sent, self.address = list(answers), [], "h:1"

    def request(self, path, payload, idempotent=True):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def send_once(self, path, payload):
        self.sent.append((path, payload))
        return {"status": "ok"}


def test_the_client_renews_its_leases_until_stopped():
    from swift_megatron.rollout.client import Lease

    lease, conn = Lease(), Conn()
    lease.hold(conn, "tok", 0.2)   # every 0.05 s
    wait_for(lambda: len(conn.sent) >= 3)
    lease.stop()
    time.sleep(0.1)
    count = len(conn.sent)
    time.sleep(0.2)
    assert len(conn.sent) == count and conn.sent[0] == ("/communicator_heartbeat",
                                                       {"token": "tok"})


def test_the_client_waits_out_another_trainers_lease():
    """409 with Retry-After: asked again after that many seconds, within
    --vllm_server_timeout; other errors (or no time left) are a UserError naming the wait."""
    from swift_megatron.errors import UserError
    from swift_megatron.rollout.client import ServerEngine, ServerError

    engine = ServerEngine.__new__(ServerEngine)
    busy = ServerError("HTTP 409: a weight-sync communicator is open", 409, retry_after=0.1)
    engine.timeout = 5.0
    assert engine._reserve(Conn([busy, busy, {"token": "t"}])) == {"token": "t"}
    engine.timeout = 0.15
    with pytest.raises(UserError, match=r"is open \(waited up to --vllm_server_timeout 0.15 s\)"):
        engine._reserve(Conn([busy, busy, busy, busy]))
    with pytest.raises(UserError, match="HTTP 500"):
        engine._reserve(Conn([ServerError("HTTP 500: broken", 500)]))


class Connection:
    """A rollout/client.py ServerConnection that posts through the app's TestClient; a request
    to `stop_at` gets SIGTERM's SystemExit (cli/rlhf.py) instead."""
    address, host, stop_at = "127.0.0.1:1", "127.0.0.1", None

    def __init__(self, http):
        self.http = http

    def request(self, path, payload=None, idempotent=True):
        if path == self.stop_at:
            raise SystemExit(143)
        answer = self.http.post(path, json=payload) if payload is not None else self.http.get(path)
        assert answer.status_code == 200, answer.text
        return answer.json()


class Communicator:
    closed = False

    def close(self):
        self.closed = True


def trainer_side(http):
    """rollout/client.py's ServerEngine on rank 0, past its connect (servers known)."""
    import torch

    from swift_megatron.rollout.client import ServerEngine

    engine = object.__new__(ServerEngine)   # __init__ connects to live servers
    engine.servers, engine.communicators, engine.reserved, engine.lease = [Connection(http)], [], \
        None, None
    engine.device, engine.timeout, engine.sync_position = torch.device("cpu"), 5.0, ""
    return engine


@pytest.mark.parametrize("stopped_in", ["/join_communicator", "open_communicator"])
def test_a_trainer_stopped_while_opening_gives_the_reservation_back(monkeypatch, stopped_in):
    """SIGTERM's SystemExit (cli/rlhf.py) while joining or meeting the replicas: the trainer's
    way out (abandon) frees the server's communicator at once, not when the lease lapses."""
    from swift_megatron.rollout import client

    http, _ = serve()
    engine = trainer_side(http)
    connection, = engine.servers

    def stop(*args):
        raise SystemExit(143)

    if stopped_in == "open_communicator":
        monkeypatch.setattr(client, "open_communicator", stop)
    else:
        connection.stop_at = stopped_in
    with pytest.raises(SystemExit):
        engine.open_communicators()
    assert http.get("/health").json()["communicator"] is not None
    connection.stop_at = None
    engine.abandon()
    assert http.get("/health").json()["communicator"] is None
    assert http.post("/init_communicator", json={}).status_code == 200   # the next trainer


def test_a_trainer_closes_the_communicator_it_opened(monkeypatch):
    from swift_megatron.rollout import client

    http, replicas = serve()
    engine = trainer_side(http)
    comm = Communicator()
    monkeypatch.setattr(client, "open_communicator", lambda *args: comm)
    engine.open_communicators()
    assert http.get("/health").json()["communicator"]["joined"] is True
    engine.close()
    assert comm.closed and http.get("/health").json()["communicator"] is None
    wait_for(lambda: all(r.commands == ["open_communicator", "close_communicator"]
                         for r in replicas))
