"""Server mode, trainer side: the RolloutEngine that talks to `megatron rollout` servers
(`--vllm_mode server --vllm_server_host h1 h2 --vllm_server_port p`).

Only global rank 0 talks to the servers:
- generate: every rank's requests are gathered on rank 0 (a gloo group over the world), sent as
  one batch split over the servers in proportion to their world size (so each server batches
  the whole rollout), and each rank gets its own completions back, in order. Every rank calls
  `generate` at the same point (the trainer's collector does), as with every collective engine.
- update_weights: at the first sync, rank 0 opens a communicator with each server (POST
  /init_communicator, /join_communicator, then NCCL on CUDA or gloo on CPU; a server whose
  communicator another trainer holds is asked again until that lease lapses, within
  --vllm_server_timeout), and for each bucket of the export stream POSTs its metadata to
  /update_weights and broadcasts the flat bucket (weight_sync.py). Every other rank drains the
  export stream, which is collective over the training ranks. Until the first sync the
  trainer holds nothing on the servers (the trainer's own checks run before it), and from then
  on a background thread renews the communicators' leases (server.py) until `close`, which
  the trainer calls on every exit path.
- routed experts (--router_replay_mode R3): every /generate asks for them; the servers must
  have been started returning them (their /health says so, checked at connection).
- rollout (servers started with --multi_turn_scheduler, named by their /health): whole
  multi-turn episodes instead of single generations, gathered and split back the same way;
  the servers run the scheduler (rollout/multi_turn) and answer with trajectories.
- Requests are retried with exponential backoff (`backoff_delays`) on connection errors (only
  when no request reached the server, for the non-idempotent weight calls); at start every
  server's /health is polled for up to `--vllm_server_timeout` seconds; a server that never
  answers is a UserError naming host:port.
"""
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from swift_megatron.arguments.rollout import API_KEY_ENV
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.data import Prompt
from swift_megatron.data.images import one_pad_per_image, png_base64
from swift_megatron.rollout.engine import (Completion, SamplingConfig, decode_routes,
                                           default_seeds)
from swift_megatron.rollout.multi_turn import MultiTurnSettings, Trajectory
from swift_megatron.rollout.vllm_compat import ROUTES_KEY
from swift_megatron.rollout.weight_sync import iter_buckets, open_communicator, pack

logger = get_logger(__name__)


def backoff_delays(retries: int, base: float = 0.5, factor: float = 2.0,
                   cap: float = 8.0) -> List[float]:
    """Seconds to sleep before each retry: base, base*factor, ... capped at `cap`."""
    return [min(cap, base * factor ** attempt) for attempt in range(retries)]


class ServerError(RuntimeError):
    """A rollout server answered with an error status (`status`; `retry_after`: seconds its
    Retry-After header asks to wait, else None)."""

    def __init__(self, message: str, status: int, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def _refused(exc: Exception) -> bool:
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, ConnectionRefusedError)


class ServerConnection:
    """JSON over HTTP to one server, with retries."""

    def __init__(self, address: str, timeout: float, retries: int = 5,
                 api_key: Optional[str] = None):
        self.address = address
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.timeout, self.retries = timeout, retries
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def request(self, path: str, payload: Optional[dict] = None, idempotent: bool = True) -> dict:
        """GET (no payload) or POST `path`; retries connection errors (for non-idempotent calls
        only a refused connection, i.e. nothing reached the server)."""
        delays = backoff_delays(self.retries)
        attempt = 0
        while True:
            try:
                return self.send_once(path, payload)
            except (urllib.error.URLError, ConnectionError, socket.timeout) as exc:
                if attempt == self.retries or not (idempotent or _refused(exc)):
                    raise UserError(f"rollout server {self.address} did not answer {path} "
                                    f"({getattr(exc, 'reason', exc)}); is `megatron rollout` "
                                    f"running there?") from None
                time.sleep(delays[attempt])
                attempt += 1

    def send_once(self, path: str, payload: Optional[dict]) -> dict:
        """One request, no retry."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"http://{self.address}{path}", data=data,
                                     headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            if exc.code == 401:
                raise UserError(f"rollout server {self.address} refused the API key ({detail}): "
                                "pass the server's --api_key as --vllm_server_api_key (or set "
                                f"${API_KEY_ENV})") from None
            retry_after = exc.headers.get("Retry-After") if exc.headers else None
            raise ServerError(f"rollout server {self.address}{path}: HTTP {exc.code}: "
                              f"{detail}", exc.code,
                              float(retry_after) if retry_after else None) from None

    def wait_healthy(self, timeout: float) -> dict:
        """Poll /health until it answers or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        delays = iter(backoff_delays(1000, base=0.2, cap=2.0))
        while True:
            try:
                return self.send_once("/health", None)
            except (urllib.error.URLError, ConnectionError, socket.timeout, ServerError) as exc:
                if time.monotonic() >= deadline:
                    raise UserError(
                        f"no rollout server answered at {self.address} within {timeout:g} s "
                        f"({getattr(exc, 'reason', exc)}): start one with `megatron rollout "
                        f"--model ... --host {self.host} --port {self.port}`, or fix "
                        "--vllm_server_host / --vllm_server_port / --vllm_server_timeout") from None
                time.sleep(min(next(delays), max(deadline - time.monotonic(), 0.0)))


def _check_routes(servers: Sequence["ServerConnection"], healths: Sequence[dict]) -> None:
    """--router_replay_mode R3: every server returns routed experts and runs no multi-turn
    scheduler (whose turns are generated apart)."""
    for server, health in zip(servers, healths):
        if health.get("multi_turn_scheduler"):
            raise UserError(f"--router_replay_mode R3: rollout server {server.address} runs the "
                            f"multi-turn scheduler {health['multi_turn_scheduler']}, whose "
                            "turns are generated apart (not supported): use R2")
        if not health.get("routed_experts"):
            raise UserError(f"--router_replay_mode R3 replays the experts vLLM chose, and rollout "
                            f"server {server.address} does not return them: restart it with "
                            f"--vllm_engine_kwargs '{{\"{ROUTES_KEY}\": true}}'")


def _proportional_split(count: int, weights: Sequence[int]) -> List[slice]:
    """Contiguous slices of `count` requests in proportion to `weights`."""
    total, bounds, start = sum(weights), [], 0
    for index, weight in enumerate(weights):
        stop = count if index == len(weights) - 1 else start + round(count * weight / total)
        bounds.append(slice(start, min(stop, count)))
        start = min(stop, count)
    return bounds


class ServerEngine:
    """The RolloutEngine of server mode (see the module docstring). `image_token_id`: a
    vision-language model's, for requests with images."""

    def __init__(self, addresses: Sequence[str], eos_token_ids: Sequence[int], *,
                 timeout: float, bucket_bytes: int, device: torch.device,
                 api_key: Optional[str] = None, image_token_id: Optional[int] = None,
                 routed_experts: bool = False):
        self.eos = list(eos_token_ids)
        self.routed_experts = routed_experts
        self.image_token_id = image_token_id
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.timeout = timeout
        self.weight_version = 0
        self.weights_discarded = False
        self.sync_position = "the weight sync to the rollout servers"
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.servers: List[ServerConnection] = []
        self.world_sizes: List[int] = []
        self.communicators: list = []
        self.reserved: Optional[Tuple[ServerConnection, str]] = None   # granted, not yet open
        self.lease: Optional[Lease] = None
        offers = [self._connect(addresses, timeout, api_key) if self.rank == 0 else None]
        if self.group is not None:
            dist.broadcast_object_list(offers, src=0, group=self.group)
        # what the servers run: their multi-turn scheduler, whether they add the gym reward
        self.server_scheduler, self.server_use_gym_env = offers[0]

    def _connect(self, addresses: Sequence[str], timeout: float,
                 api_key: Optional[str]) -> Tuple[Optional[str], bool]:
        """Wait for every server's /health; (the multi-turn scheduler they run, whether they
        supply the gym reward). Nothing is opened on them yet (see open_communicators)."""
        self.servers = [ServerConnection(a, timeout, api_key=api_key) for a in addresses]
        healths = [s.wait_healthy(timeout) for s in self.servers]
        self.world_sizes = [int(h["world_size"]) for h in healths]
        if self.routed_experts:
            _check_routes(self.servers, healths)
        offers = {(h.get("multi_turn_scheduler"), bool(h.get("use_gym_env"))) for h in healths}
        if len(offers) > 1:
            raise UserError("the rollout servers run different multi-turn settings (" + ", ".join(
                f"{s.address}: --multi_turn_scheduler {h.get('multi_turn_scheduler')} "
                f"--use_gym_env {bool(h.get('use_gym_env'))}"
                for s, h in zip(self.servers, healths))
                + "): start them all with the same flags")
        logger.info("rollout servers: " + ", ".join(
            f"{s.address} (vLLM world {w})" for s, w in zip(self.servers, self.world_sizes)))
        return offers.pop()

    def open_communicators(self) -> None:
        """Rank 0: a weight-sync communicator with every server, each kept alive by the Lease
        from the moment it opens (the next server may make us wait for another trainer's).
        `close` gives back a reservation from the moment a server grants it: a stop while
        joining or meeting the replicas (SIGTERM's SystemExit, an error) holds nothing."""
        self.lease = Lease()
        for server in self.servers:
            self.sync_position = f"opening the weight-sync communicator with {server.address}"
            info = self._reserve(server)
            self.reserved = (server, info["token"])
            comm = self._join(server, info)
            self.communicators.append((comm, info["client_rank"], info["token"], info))
            self.reserved = None
            self.lease.hold(server, info["token"], info["lease_s"])

    def _join(self, server: "ServerConnection", info: dict):
        """Join the reserved communicator and meet the server's replicas in it."""
        if info["backend"] == "nccl" and self.device.type != "cuda":
            raise UserError(f"rollout server {server.address} runs on CUDA (NCCL weight sync) but "
                            "this trainer runs on the CPU")
        server.request("/join_communicator", {"token": info["token"]}, idempotent=False)
        return open_communicator(info["backend"], server.host, info["port"], info["client_rank"],
                                 info["world_size"], self.device)

    def _reserve(self, server: "ServerConnection") -> dict:
        """POST /init_communicator, again while another trainer's lease runs (409 with
        Retry-After), for up to the --vllm_server_timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return server.request("/init_communicator", {}, idempotent=False)
            except ServerError as exc:
                left = deadline - time.monotonic()
                if exc.status != 409 or exc.retry_after is None or left <= 0:
                    raise UserError(f"{exc} (waited up to --vllm_server_timeout "
                                    f"{self.timeout:g} s)") from None
                logger.warning(f"rollout server {server.address}: another trainer holds the "
                               f"weight-sync communicator; asking again in {exc.retry_after:g} s")
                time.sleep(min(exc.retry_after, max(left, 0.1)))

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seeds: Optional[Sequence[int]] = None,
                 images: Optional[Sequence[Optional[dict]]] = None) -> List[Completion]:
        """`images`: per request None or its encoded images (data/images.py); the request then
        carries them as base64 PNGs with one image pad per image in its tokens."""
        seeds = list(seeds) if seeds is not None else default_seeds(sampling, len(prompts))
        requests = [(list(p), None) for p in prompts]
        for index, encoded in enumerate(images or []):
            if encoded is not None:
                requests[index] = (one_pad_per_image(requests[index][0], self.image_token_id),
                                   [png_base64(image) for image in encoded["images"]])
        return self._collective((requests, seeds),
                                lambda server, requests, seeds_: self._request_generate(
                                    server, requests, seeds_, sampling))

    def rollout(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seeds: Sequence[int],
                settings: MultiTurnSettings) -> List[Trajectory]:
        """Whole multi-turn episodes, run by the servers' scheduler (collective, as generate)."""
        return self._collective((list(prompts), list(seeds)),
                                lambda server, requests, seeds_: self._request_rollout(
                                    server, requests, seeds_, sampling, settings))

    def _collective(self, mine: Tuple[list, List[int]], send) -> list:
        """Every rank's (requests, seeds) gathered on rank 0, sent with `send(server, requests,
        seeds)` as one batch split over the servers, and each rank's answers back, in order."""
        if self.group is None:
            return self._send_all([mine], send)[0]
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.group)
        results = self._send_all(gathered, send) if self.rank == 0 else None
        received = [None]
        dist.scatter_object_list(received, results, src=0, group=self.group)
        return received[0]

    def _send_all(self, parts: List[Tuple[list, List[int]]], send) -> List[list]:
        """Rank 0: every rank's requests as one batch over the servers, split back per rank."""
        requests = [p for part, _ in parts for p in part]
        seeds = [s for _, part in parts for s in part]
        slices = _proportional_split(len(requests), self.world_sizes)
        jobs = [(server, s) for server, s in zip(self.servers, slices) if s.stop > s.start]
        with ThreadPoolExecutor(max(len(jobs), 1)) as pool:
            answers = list(pool.map(lambda job: send(job[0], requests[job[1]], seeds[job[1]]),
                                    jobs))
        flat = [c for answer in answers for c in answer]
        out, start = [], 0
        for part, _ in parts:
            out.append(flat[start:start + len(part)])
            start += len(part)
        return out

    def _request_generate(self, server: ServerConnection, prompts, seeds,
                          sampling: SamplingConfig) -> List[Completion]:
        payload = dict(prompts=[ids for ids, _ in prompts], seeds=seeds,
                       max_tokens=sampling.max_tokens,
                       temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=sampling.top_k, repetition_penalty=sampling.repetition_penalty,
                       stop_token_ids=self.eos)
        if any(pictures for _, pictures in prompts):
            payload["images"] = [pictures for _, pictures in prompts]
        if self.routed_experts:
            payload["return_routed_experts"] = True
        answer = server.request("/generate", payload)
        if self.routed_experts and not all(c.get("routed_experts") for c in answer["completions"]):
            raise RuntimeError(f"rollout server {server.address} returned completions without "
                               "their routed experts (--router_replay_mode R3)")
        return [Completion(c["token_ids"], c["logprobs"], c["finish_reason"], self.weight_version,
                           decode_routes(c["routed_experts"]) if self.routed_experts else None)
                for c in answer["completions"]]

    def _request_rollout(self, server: ServerConnection, prompts: List[Prompt], seeds,
                         sampling: SamplingConfig, settings: MultiTurnSettings) -> List[Trajectory]:
        payload = dict(prompts=[list(p.input_ids) for p in prompts],
                       messages=[p.messages for p in prompts],
                       columns=[p.columns for p in prompts], row_ids=[p.prompt_id for p in prompts],
                       seeds=seeds, max_tokens=sampling.max_tokens,
                       temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=sampling.top_k, repetition_penalty=sampling.repetition_penalty,
                       stop_token_ids=self.eos, max_length=settings.max_length,
                       limit_scope=settings.limit_scope, template_kwargs=settings.template_kwargs)
        answer = server.request("/rollout", payload)
        return [Trajectory(**dict(t, weight_version=self.weight_version))
                for t in answer["trajectories"]]

    # ---- weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        if self.rank != 0:
            self.sync_position = f"rank {self.rank} exporting its share (rank 0 sends to the " \
                                 "rollout servers)"
            for _ in named_tensors:  # the export stream is collective: drain it
                pass
        else:
            if not self.communicators:
                self.open_communicators()
            for index, (bucket, last) in enumerate(iter_buckets(named_tensors, self.bucket_bytes)):
                self._push_bucket(bucket, last, index)
        self.weight_version += 1

    def _push_bucket(self, bucket, last: bool, index: int = 0) -> None:
        device = self.communicators[0][0].device
        specs, flat = pack(bucket, device)
        meta = {"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
                "shapes": [list(s.shape) for s in specs], "last": last}
        what = f"bucket {index} ({len(specs)} tensors, {specs[0].name} .. {specs[-1].name})"
        for server, (_, _, token, _) in zip(self.servers, self.communicators):
            self.sync_position = f"announcing {what} to rollout server {server.address}"
            server.request("/update_weights", dict(meta, token=token), idempotent=False)
        for server, (comm, client_rank, _, _) in zip(self.servers, self.communicators):
            self.sync_position = f"broadcasting {what} to rollout server {server.address}'s " \
                                 "replicas"
            comm.broadcast(flat, client_rank)

    # ---- the rest of the protocol ----------------------------------------------------------
    def sleep(self) -> None:
        return None  # the servers keep their GPUs

    def wake_up(self) -> None:
        return None

    def close(self) -> None:
        """Give back every communicator and a reservation not yet open (idempotent, and safe on
        a failing run's way out: a server that does not answer is logged; its lease then
        lapses)."""
        if self.lease is not None:
            self.lease.stop()
        held = [(server, token, comm)
                for server, (comm, _, token, _) in zip(self.servers, self.communicators)]
        for server, token, comm in held + ([(*self.reserved, None)] if self.reserved else []):
            try:
                server.request("/close_communicator", {"token": token}, idempotent=False)
            except (UserError, ServerError) as exc:
                logger.warning(f"closing the weight-sync communicator: {exc}")
            if comm is not None:
                comm.close()
        self.communicators, self.servers, self.lease, self.reserved = [], [], None, None


    def abandon(self) -> None:
        self.close()   # rank 0's HTTP calls and its own side of the communicators only


class Lease:
    """A daemon thread that renews the communicators' leases (POST /communicator_heartbeat)
    every quarter of the shortest of the servers' --communicator_lease, until `stop`."""

    def __init__(self):
        self.holders: List[Tuple[ServerConnection, str]] = []
        self.period = float("inf")
        self.stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def hold(self, server: ServerConnection, token: str, lease_s: float) -> None:
        self.holders.append((server, token))
        self.period = min(self.period, lease_s / 4)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True,
                                           name="communicator_lease")
            self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.period):
            for server, token in list(self.holders):
                try:
                    server.send_once("/communicator_heartbeat", {"token": token})
                except (ServerError, urllib.error.URLError, ConnectionError,
                        socket.timeout) as exc:
                    logger.warning(f"weight-sync lease on {server.address} not renewed: {exc}")

    def stop(self) -> None:
        self.stopped.set()
