"""`megatron rollout`: vLLM behind HTTP for server-mode training (`--vllm_mode server`).

    megatron rollout --model Qwen/Qwen3-0.6B --vllm_tensor_parallel_size 1 \
        --vllm_data_parallel_size 2 --host 0.0.0.0 --port 8000

`--vllm_data_parallel_size D` engine replicas run in one process each (rollout/replicas.py;
replica r on GPUs r*T .. r*T+T-1 of the visible ones, `--vllm_tensor_parallel_size T`); the HTTP
process (FastAPI + uvicorn, which come with vLLM) splits every generate request over them and
sends weight updates to all of them. Endpoints (JSON; docs/rollout.md has request/response
examples):

    GET  /health              {"status": "ok", "world_size", "weight_version",
                              "weight_sync_error", "communicator" (null, or whether it is
                              joined and the seconds left on its lease), "multi_turn_scheduler",
                              "use_gym_env", "routed_experts"} (503 once a replica exited)
    GET  /get_world_size      {"world_size": T x D}
    POST /generate            prompts (token ids or text), per-request seeds, sampling params,
                              optionally per-request images (base64 image files; the prompt
                              holds one image pad per image, vLLM expands it)
                              -> token ids, logprobs, finish reasons (routed experts on request)
    POST /init_communicator   -> {"port", "world_size", "client_rank", "backend", "token",
                              "lease_s"}: reserves the weight-sync communicator for this client
                              (the replicas do nothing yet, so generation never waits on it)
    POST /join_communicator   {"token"}: the replicas join the weight-sync group, and the
                              trainer right after (NCCL on CUDA, gloo on CPU)
    POST /communicator_heartbeat  {"token"}: renews the lease
    POST /update_weights      one bucket's metadata and the token; the tensors follow over the
                              communicator
    POST /reset_prefix_cache
    POST /close_communicator  {"token"}

One trainer owns the communicator at a time, on a lease of --communicator_lease seconds that
every request carrying its token renews (a trainer sends a heartbeat every quarter of it). The
communicator of a trainer that stopped renewing it (killed, crashed, cut off) is freed once the
lease lapses: another trainer's /init_communicator is answered 409 with a Retry-After header
until then, and succeeds after.
    POST /rollout             with --multi_turn_scheduler: whole multi-turn episodes (prompt
                              token ids, chat messages, dataset columns, seeds, sampling and
                              length budget) -> trajectories with loss masks and rollout_infos

With `--multi_turn_scheduler` the server runs the scheduler itself (rollout/multi_turn), as
ms-swift's rollout server does; /health then names it, and trainers send /rollout requests
instead of /generate.

Malformed requests get a 4xx with a message (422: invalid JSON or fields, 400: values the model
cannot take, 409: out of order, 403: another client's communicator token; 401: a missing or
wrong --api_key) and the server keeps serving. The engines load the checkpoint's
real weights at start, so generation works before any update.
"""
import dataclasses
import hmac
import json
import os
import secrets
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

from swift_megatron.errors import ServiceFailure, UserError
from swift_megatron.logging import get_logger
from swift_megatron.rollout import vllm_compat
from swift_megatron.rollout.requests import (check_bucket, check_generate, decode_images,
                                             request_models)
from swift_megatron.rollout.replicas import (STOP_GRACE_S, Replica, ReplicaError,
                                             spawn_replicas, start_engines, stop_all)

logger = get_logger(__name__)

REPLICA_POLL_S = 1.0      # how often the server checks that its replicas are alive
SHUTDOWN_GRACE_S = 10.0   # in-flight requests get this long once the server is stopping


# ---- the HTTP application ----------------------------------------------------------------------
@dataclasses.dataclass
class ServerState:
    replicas: List[Replica]
    tensor_parallel_size: int
    vocab_size: int
    host: str
    backend: str                     # weight-sync backend: "nccl" (CUDA) or "gloo" (CPU)
    communicator_timeout: float = 120.0   # seconds to join the communicator / per broadcast
    communicator_lease: float = 60.0      # seconds the owner keeps it without renewing
    weight_version: int = 0          # weight updates loaded by every replica
    client_rank: Optional[int] = None
    communicator_token: Optional[str] = None   # given to the client that opened it
    joined: bool = False             # whether the replicas were told to join (/join_communicator)
    port: int = 0                    # the reserved communicator's port
    lease_until: float = 0.0         # time.monotonic() at which the owner's lease lapses
    sync_error: Optional[str] = None           # why the open communicator's last update failed
    # why the last weight update did not complete (its complete layers were loaded, the rest
    # kept their previous weights), until an update completes; /health reports it
    update_error: Optional[str] = None
    multi_turn: Optional["MultiTurnService"] = None   # --multi_turn_scheduler
    routed_experts: bool = False     # the engines return routed experts (--vllm_engine_kwargs)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * len(self.replicas)


def _split(count: int, parts: int) -> List[slice]:
    per, extra = divmod(count, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + per + (1 if part < extra else 0)
        bounds.append(slice(start, stop))
        start = stop
    return bounds


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _replica_call(state: ServerState, method: str, *args, **kwargs) -> list:
    """Run a command on every replica (call: wait for each; submit: return at once)."""
    from fastapi import HTTPException

    try:
        return [getattr(replica, method)(*args, **kwargs) for replica in state.replicas]
    except ReplicaError as exc:
        raise HTTPException(400 if exc.bad_input else 500, str(exc)) from None


def _sampling(request) -> Dict[str, Any]:
    return dict(max_tokens=request.max_tokens, temperature=request.temperature,
                top_p=request.top_p, top_k=request.top_k,
                repetition_penalty=request.repetition_penalty)


def _generate_on_replicas(state: ServerState, prompts: list, sampling: Dict[str, Any],
                          seeds: list, stop_token_ids: List[int], logprobs: bool,
                          images: Optional[list] = None, routes: bool = False) -> List[dict]:
    """`prompts` (and their `images`) split over the replicas, generated concurrently, in
    order; `routes`: with each completion's routed experts (null where the engine has none)."""
    from fastapi import HTTPException

    slices = _split(len(prompts), len(state.replicas))
    parts = [(r, s) for r, s in zip(state.replicas, slices) if s.stop > s.start]
    with ThreadPoolExecutor(max(len(parts), 1)) as pool:
        futures = [pool.submit(replica.call, "generate", prompts=prompts[s], sampling=sampling,
                               seeds=seeds[s], stop_token_ids=stop_token_ids, logprobs=logprobs,
                               images=None if images is None else images[s], routes=routes)
                   for replica, s in parts]
        try:
            results = [f.result() for f in futures]
        except ReplicaError as exc:
            raise HTTPException(400 if exc.bad_input else 500, str(exc)) from None
    return [c for part in results for c in part]


def _generate(state: ServerState, request) -> dict:
    check_generate(request, state.vocab_size)
    seeds = request.seeds or [None] * len(request.prompts)
    completions = _generate_on_replicas(state, request.prompts, _sampling(request), seeds,
                                        request.stop_token_ids, request.logprobs,
                                        decode_images(request), request.return_routed_experts)
    return {"completions": completions, "weight_version": state.weight_version}


# ---- multi-turn rollouts (--multi_turn_scheduler) ----------------------------------------------
@dataclasses.dataclass
class MultiTurnService:
    """The server's scheduler, and the tokenizer that renders its messages. One rollout runs
    at a time (schedulers and their event loop are not shared between threads)."""

    name: str
    scheduler: Any
    tokenizer: Any
    max_turns: Optional[int]
    use_gym_env: bool = False                 # whether trainers add the gym reward (/health)
    max_length: Optional[int] = None          # --max_length: caps each request's
    template_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)   # defaults
    agent_template: Optional[str] = None      # --agent_template
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class _ReplicaEngine:
    """The RolloutEngine the multi-turn loop drives inside the server: the replicas."""

    def __init__(self, state: ServerState, stop_token_ids: List[int]):
        self.state, self.stop_token_ids = state, stop_token_ids
        self.weight_version = state.weight_version

    def generate(self, prompts, sampling, seeds=None) -> list:
        from swift_megatron.rollout.engine import Completion

        if not prompts:
            return []
        sampling_dict = dict(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                             top_p=sampling.top_p, top_k=sampling.top_k,
                             repetition_penalty=sampling.repetition_penalty)
        out = _generate_on_replicas(self.state, [list(p) for p in prompts], sampling_dict,
                                    list(seeds or [None] * len(prompts)), self.stop_token_ids,
                                    True)
        return [Completion(c["token_ids"], c["logprobs"], c["finish_reason"],
                           self.weight_version) for c in out]


def _rollout(state: ServerState, request) -> dict:
    """Whole episodes with the server's scheduler (rollout/multi_turn/runner.py)."""
    from fastapi import HTTPException

    from swift_megatron.data import Prompt
    from swift_megatron.rollout.engine import SamplingConfig
    from swift_megatron.rollout.multi_turn import MultiTurnSettings, run_episodes

    service = state.multi_turn
    if service is None:
        raise HTTPException(409, "this server runs no multi-turn scheduler: start it with "
                                 "--multi_turn_scheduler, or send /generate requests")
    check_generate(request, state.vocab_size)
    if request.images:
        raise HTTPException(400, "images: multi-turn rollouts with images are not supported")
    count = len(request.prompts)
    columns = request.columns or [{}] * count
    row_ids = request.row_ids or list(range(count))
    if not len(request.messages) == len(columns) == len(row_ids) == count:
        raise HTTPException(400, f"prompts, messages, columns and row_ids differ in length "
                                 f"({count}, {len(request.messages)}, {len(columns)}, "
                                 f"{len(row_ids)})")
    prompts = [Prompt(row, "", list(ids), messages, dict(cols))
               for row, ids, messages, cols in zip(row_ids, request.prompts, request.messages,
                                                   columns)]
    sampling = SamplingConfig(**_sampling(request))
    settings = MultiTurnSettings(max_completion_length=request.max_tokens,
                                 max_length=min(request.max_length,
                                                service.max_length or request.max_length),
                                 max_turns=service.max_turns, limit_scope=request.limit_scope,
                                 template_kwargs={**service.template_kwargs,
                                                  **request.template_kwargs},
                                 agent_template=service.agent_template)
    seeds = [s if s is not None else i for i, s in enumerate(request.seeds or [None] * count)]
    engine = _ReplicaEngine(state, request.stop_token_ids)
    try:
        with service.lock:
            trajectories = run_episodes(engine, service.tokenizer, service.scheduler, prompts,
                                        sampling, seeds, settings)
    except UserError as exc:
        raise HTTPException(400, str(exc)) from None
    return {"trajectories": [dataclasses.asdict(t) for t in trajectories],
            "weight_version": state.weight_version}


def check_multi_turn_names(args) -> None:
    """Load --external_plugins (with or without a scheduler: a file that fails to import is a
    UserError naming it) and check the scheduler and gym env names they and the built-ins
    register: before any engine process starts (a typo cost a vLLM start before)."""
    options = args.multi_turn
    if options.multi_turn_scheduler is None and not options.external_plugins:
        return
    import swift_megatron.compat.ms_swift  # noqa: F401  (ms-swift plugin files load)
    import swift_megatron.rollout.multi_turn  # noqa: F401  (registers the built-ins)
    from swift_megatron.rewards import load_plugins
    from swift_megatron.rollout.plugin_registry import GYM_ENVS, SCHEDULERS

    load_plugins(options.external_plugins)
    if options.multi_turn_scheduler is None:
        return
    SCHEDULERS.lookup(options.multi_turn_scheduler)
    if options.gym_env is not None:
        GYM_ENVS.lookup(options.gym_env)


def multi_turn_service(args, model_dir: str) -> Optional[MultiTurnService]:
    """--multi_turn_scheduler's scheduler (after check_multi_turn_names), or None."""
    options = args.multi_turn
    if options.multi_turn_scheduler is None:
        return None
    from transformers import AutoTokenizer

    from swift_megatron.compat.ms_swift import flat_args
    from swift_megatron.rollout.multi_turn import build_scheduler

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scheduler = build_scheduler(options.multi_turn_scheduler, max_turns=options.max_turns,
                                tokenizer=tokenizer, args=flat_args(args))
    thinking = options.enable_thinking
    return MultiTurnService(options.multi_turn_scheduler, scheduler, tokenizer, options.max_turns,
                            options.use_gym_env, options.max_length,
                            {} if thinking is None else {"enable_thinking": thinking},
                            options.agent_template)


def _when_all_done(count: int, then: Callable[[List[ReplicaError]], None]):
    """An `on_done` callback for `count` replicas that calls then(errors) after the last reply."""
    lock, errors, remaining = threading.Lock(), [], [count]

    def done(error: Optional[ReplicaError]) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            then(errors)
    return done


def _renew(state: ServerState) -> None:
    state.lease_until = time.monotonic() + state.communicator_lease


def _release(state: ServerState) -> None:
    """Forget the communicator; the replicas close their side (in the background: a join, or a
    receive that waits on a dead trainer, holds a replica until --communicator_timeout)."""
    joined = state.joined
    state.client_rank = state.communicator_token = state.sync_error = None
    state.joined = False
    if joined:
        threading.Thread(target=_close_replicas, args=(state.replicas,), daemon=True).start()


def _close_replicas(replicas: List[Replica]) -> None:
    for replica in replicas:
        try:
            replica.call("close_communicator")
        except ReplicaError as exc:
            logger.warning(f"closing the weight-sync communicator: {exc}")


def _expire(state: ServerState) -> None:
    """Free the communicator whose owner's lease lapsed (the trainer died or was cut off)."""
    if state.client_rank is not None and time.monotonic() > state.lease_until:
        logger.warning(f"weight-sync communicator freed: its trainer sent no sign of life for "
                       f"--communicator_lease {state.communicator_lease:g} s")
        _release(state)


def _init_communicator(state: ServerState, request) -> dict:
    """Reserve the weight-sync communicator for the caller (nothing happens in the replicas
    until /join_communicator, so a client that never joins holds no generation); 409 with
    Retry-After while another trainer's lease runs."""
    from fastapi import HTTPException

    _expire(state)
    if state.client_rank is not None:
        wait = max(1, round(state.lease_until - time.monotonic() + 0.5))
        raise HTTPException(409, f"a weight-sync communicator is open (another trainer's; its "
                                 f"lease lapses within {wait} s unless renewed): retry then, or "
                                 "its owner POSTs /close_communicator",
                            headers={"Retry-After": str(wait)})
    port = request.port or free_port(state.host)
    world_size = state.world_size + 1
    token = secrets.token_urlsafe(16)
    state.client_rank, state.communicator_token, state.sync_error = world_size - 1, token, None
    state.port, state.joined = port, False
    _renew(state)
    return {"port": port, "world_size": world_size, "client_rank": state.client_rank,
            "backend": state.backend, "token": token, "lease_s": state.communicator_lease}


def _join_communicator(state: ServerState, request) -> dict:
    """The replicas join the reserved group; each waits for the trainer to join it for up to
    --communicator_timeout seconds, after which the communicator is freed again."""
    from fastapi import HTTPException

    _owned(state, request.token)
    if state.joined:
        raise HTTPException(409, "the weight-sync communicator was joined already")
    token, state.joined = state.communicator_token, True
    _renew(state)

    def opened(errors: List[ReplicaError]) -> None:
        if errors and state.communicator_token == token:
            logger.warning(f"weight-sync communicator closed: the trainer did not join within "
                           f"--communicator_timeout {state.communicator_timeout:g} s "
                           f"({errors[0]})")
            state.joined = False   # (the replicas' failed join left nothing to close)
            _release(state)

    done = _when_all_done(len(state.replicas), opened)
    try:
        for replica in state.replicas:
            replica.submit("open_communicator", done, backend=state.backend, host=state.host,
                           port=state.port, world_size=state.world_size + 1,
                           rank_offset=replica.index * state.tensor_parallel_size,
                           timeout_s=state.communicator_timeout)
    except ReplicaError as exc:
        state.client_rank = state.communicator_token = None
        state.joined = False
        raise HTTPException(500, str(exc)) from None
    return {"status": "ok"}


def _owned(state: ServerState, token: Optional[str]) -> None:
    """409 without a communicator (or once its lease lapsed), 403 unless `token` is the one
    /init_communicator gave (only its client may join, push weights, renew or close); renews
    the lease."""
    from fastapi import HTTPException

    _expire(state)
    if state.client_rank is None:
        raise HTTPException(409, "no weight-sync communicator (none opened, or its lease "
                                 "lapsed): POST /init_communicator first")
    if not hmac.compare_digest((token or "").encode(), state.communicator_token.encode()):
        raise HTTPException(403, "token: the weight-sync communicator belongs to another client")
    _renew(state)


def _update_weights(state: ServerState, request) -> dict:
    """Start receiving one bucket on every replica; the weight version counts an update once
    every replica has loaded its last bucket."""
    from fastapi import HTTPException

    check_bucket(request)
    _owned(state, request.token)
    if not state.joined:
        raise HTTPException(409, "the weight-sync communicator is not joined: POST "
                                 "/join_communicator first")
    if state.sync_error is not None:
        raise HTTPException(500, f"the previous weight bucket failed ({state.sync_error}); POST "
                                 "/close_communicator and open a new one")
    specs = [{"name": n, "dtype": d, "shape": s}
             for n, d, s in zip(request.names, request.dtypes, request.shapes)]

    def received(errors: List[ReplicaError]) -> None:
        if errors:
            logger.warning(f"weight update failed: {errors[0]}")
            state.sync_error = state.update_error = str(errors[0])
        elif request.last:
            state.weight_version += 1
            state.update_error = None

    done = _when_all_done(len(state.replicas), received)
    _replica_call(state, "submit", "receive", done, specs=specs, src=state.client_rank,
                  last=request.last)
    return {"status": "ok", "weight_version": state.weight_version}


def _close_communicator(state: ServerState, request) -> dict:
    """Free the caller's communicator (a client without one gets ok: closing is idempotent)."""
    _expire(state)
    if state.client_rank is not None:
        _owned(state, request.token)
        _release(state)
    return {"status": "ok"}


def _communicator_health(state: ServerState) -> Optional[dict]:
    _expire(state)
    if state.client_rank is None:
        return None
    return {"joined": state.joined,
            "lease_left_s": round(max(state.lease_until - time.monotonic(), 0.0), 1)}


def _bearer_check(api_key: str):
    """A FastAPI dependency: 401 unless the request carries `Authorization: Bearer <api_key>`
    (compared in constant time)."""
    from fastapi import HTTPException, Request

    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise HTTPException(401, "missing or wrong API key: send `Authorization: Bearer "
                                     "<key>` (megatron rlhf: --vllm_server_api_key)")
    return check


async def _invalid_request(request, exc):
    """422 with each problem's location and message. FastAPI's own handler echoes the input,
    which fails to serialise when it holds NaN or infinity (a plain-text 500)."""
    from fastapi.responses import JSONResponse

    detail = [{"loc": list(error.get("loc", ())), "msg": str(error.get("msg", "")),
               "type": str(error.get("type", ""))} for error in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": detail})


async def _unexpected_error(request, exc):
    """500 with a JSON body naming the error (Starlette's default is plain text); the traceback
    still goes to the server's log."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=500,
                        content={"detail": f"internal error: {type(exc).__name__}: {exc}"})


def build_app(state: ServerState, api_key: Optional[str] = None, enable_docs: bool = False):
    """The FastAPI application over the replicas (handlers are sync: they run in a thread pool,
    so /health answers while a generation is running). With `api_key`, every endpoint needs it;
    the docs endpoints only with `enable_docs`."""
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError

    models = request_models()
    GenerateRequest, RolloutRequest = models[0], models[4]
    docs = dict(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json") \
        if enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    auth = [Depends(_bearer_check(api_key))] if api_key else []
    app = FastAPI(title="swift-megatron rollout server", dependencies=auth, **docs)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _unexpected_error)

    @app.get("/health")
    def health():
        reasons = [r for r in (replica.exit_reason() for replica in state.replicas) if r]
        if reasons:
            raise HTTPException(503, "; ".join(reasons))
        return {"status": "ok", "world_size": state.world_size,
                "weight_version": state.weight_version, "weight_sync_error": state.update_error,
                "communicator": _communicator_health(state),
                "multi_turn_scheduler": state.multi_turn.name if state.multi_turn else None,
                "use_gym_env": bool(state.multi_turn and state.multi_turn.use_gym_env),
                "routed_experts": state.routed_experts}

    @app.get("/get_world_size")
    def get_world_size():
        return {"world_size": state.world_size}

    @app.post("/generate")
    def generate(request: GenerateRequest):
        return _generate(state, request)

    @app.post("/rollout")
    def rollout(request: RolloutRequest):
        return _rollout(state, request)

    _add_weight_sync_routes(app, state, models)

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        _replica_call(state, "call", "reset_prefix_cache")
        return {"status": "ok"}

    return app


def _add_weight_sync_routes(app, state: ServerState, models: tuple) -> None:
    """The weight-sync communicator's endpoints: reserve, join, renew its lease, load a
    bucket, close; `models`: request_models()'s request classes."""
    _, InitCommunicatorRequest, UpdateWeightsRequest, CloseRequest, _, TokenRequest = models

    @app.post("/init_communicator")
    def init_communicator(request: InitCommunicatorRequest):
        return _init_communicator(state, request)

    @app.post("/join_communicator")
    def join_communicator(request: TokenRequest):
        return _join_communicator(state, request)

    @app.post("/communicator_heartbeat")
    def communicator_heartbeat(request: TokenRequest):
        _owned(state, request.token)
        return {"status": "ok", "lease_s": state.communicator_lease}

    @app.post("/update_weights")
    def update_weights(request: UpdateWeightsRequest):
        return _update_weights(state, request)

    @app.post("/close_communicator")
    def close_communicator(request: CloseRequest):
        return _close_communicator(state, request)


# ---- the command -----------------------------------------------------------------------------
def _vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return int((config.get("text_config") or config)["vocab_size"])


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({exc})") from None


def engine_settings(args, model_dir: str) -> "vllm_compat.EngineSettings":
    """The replicas' engine settings from the flags (RolloutCommandArguments): the checkpoint's
    real weights, vLLM's default seed; a vision-language model's images capped by --max_pixels
    (else MAX_PIXELS; as the trainer's); --vllm_engine_kwargs adds to them (the flags win)."""
    from swift_megatron.data.images import resolve_max_pixels
    from swift_megatron.rollout.factory import vision_engine_kwargs
    from swift_megatron.rollout.weight_sync import WORKER_EXTENSION

    engine = args.vllm
    return vllm_compat.EngineSettings(
        model=model_dir, dtype=args.model.torch_dtype,
        tensor_parallel_size=engine.vllm_tensor_parallel_size,
        gpu_memory_utilization=engine.vllm_gpu_memory_utilization,
        max_model_len=engine.vllm_max_model_len, max_num_seqs=engine.vllm_max_num_seqs,
        enforce_eager=engine.vllm_enforce_eager,
        enable_prefix_caching=engine.vllm_enable_prefix_caching,
        disable_cascade_attn=engine.vllm_disable_cascade_attn,
        worker_extension_cls=WORKER_EXTENSION,
        extra={**vision_engine_kwargs(model_dir, resolve_max_pixels(args.serve.max_pixels),
                                      dummy_weights=False),
               **(engine.vllm_engine_kwargs or {})})


def _exit_on_signal(signum, frame) -> None:
    """SIGTERM (and SIGINT) outside uvicorn's own handling: leave through the `finally` that
    stops the replicas, which a second signal must not interrupt. (uvicorn restores this
    handler after serving and re-raises the signal; with Python's default SIGTERM action the
    process would die before stopping them.)"""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(0)


def _once(action: Callable[..., None]) -> Callable[..., None]:
    """`action` run by the first caller only; later callers wait until it has finished."""
    lock, done = threading.Lock(), []

    def run(*args) -> None:
        with lock:
            if not done:
                done.append(True)
                action(*args)
    return run


def _watch_replicas(replicas: List[Replica], server, served: threading.Event,
                    stop_replicas: Callable[[float], None], died: List[str]) -> None:
    """Stop the HTTP server as soon as a replica process exits (the command then exits 1,
    naming it and its exit code or signal). Once the server is stopping (for that reason, or
    SIGTERM / SIGINT), in-flight requests get SHUTDOWN_GRACE_S, then the replicas are
    terminated (then killed), which also ends the requests a wedged replica holds."""
    while not (server.should_exit or served.is_set()):
        reasons = [r for r in (replica.exit_reason() for replica in replicas) if r]
        if reasons and not served.is_set():   # (set before the replicas are stopped)
            logger.error("; ".join(reasons) + ": stopping the server")
            died.extend(reasons)
            server.should_exit = True
            break
        time.sleep(REPLICA_POLL_S)
    if not served.wait(SHUTDOWN_GRACE_S):
        logger.warning(f"requests still running {SHUTDOWN_GRACE_S:g} s after the stop: "
                       "terminating the replicas under them")
        stop_replicas(0.0)


def serve(args) -> None:
    """Run `megatron rollout` (RolloutCommandArguments) until interrupted (SIGINT or SIGTERM:
    exit 0) or until a replica process exits (exit 1, naming it); the replicas and their engine
    processes are stopped either way, within a bound (SHUTDOWN_GRACE_S for in-flight requests,
    then replicas.stop_all's)."""
    try:
        import uvicorn
    except ImportError:
        raise UserError("megatron rollout needs vLLM (FastAPI and uvicorn come with it)") from None
    from swift_megatron.model.hub import resolve_model_dir

    serve_args, engine = args.serve, args.vllm
    _check_port_free(serve_args.host, serve_args.port)
    model_dir = resolve_model_dir(args.model.model, args.model.use_hf, args.model.model_revision)
    if args.model.check_model:
        from swift_megatron.model.files import check_model_dir

        check_model_dir(model_dir)
    check_multi_turn_names(args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_on_signal)
    # the replicas import vLLM (seconds) while this process does for its checks
    replicas = spawn_replicas(serve_args.vllm_data_parallel_size, engine.vllm_tensor_parallel_size)
    try:
        vllm_compat.check_model_supported(model_dir, args.model.torch_dtype)
        settings = engine_settings(args, model_dir)
        vllm_compat.check_engine_settings(settings)
        multi_turn = multi_turn_service(args, model_dir)
    except BaseException:   # no engine to finish: terminate at once
        stop_all(replicas, grace_s=0)
        raise
    start_engines(replicas, settings)
    stop_replicas = _once(lambda grace_s=STOP_GRACE_S: stop_all(replicas, grace_s))
    served, died = threading.Event(), []
    try:
        state = ServerState(replicas, engine.vllm_tensor_parallel_size, _vocab_size(model_dir),
                            serve_args.host, "gloo" if vllm_compat.on_cpu() else "nccl",
                            serve_args.communicator_timeout, serve_args.communicator_lease,
                            multi_turn=multi_turn, routed_experts=settings.returns_routes)
        logger.info(f"rollout server: {len(replicas)} replica(s) x TP {state.tensor_parallel_size} "
                    f"on http://{serve_args.host}:{serve_args.port}")
        app = build_app(state, serve_args.api_key, serve_args.enable_docs)
        server = uvicorn.Server(uvicorn.Config(app, host=serve_args.host, port=serve_args.port,
                                               log_level="warning"))
        threading.Thread(target=_watch_replicas, daemon=True,
                         args=(replicas, server, served, stop_replicas, died)).start()
        server.run()
    finally:
        served.set()
        stop_replicas()
    if died:
        raise ServiceFailure("; ".join(died) + " (see the log above): the server stopped")
