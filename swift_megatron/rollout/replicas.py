"""The engine replicas of `megatron rollout` (rollout/server.py): one process per replica, each
holding a vLLM engine on its own GPUs (`--vllm_data_parallel_size` x `--vllm_tensor_parallel_size`),
driven over a pipe by the HTTP process; their start, readiness, calls and stop, and the error a
replica reports back (`ReplicaError`: `bad_input` when vLLM rejected the request)."""
import os
import threading
from typing import Any, Callable, Dict, List, Optional

from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.rollout import vllm_compat
from swift_megatron.rollout.engine import encode_routes

logger = get_logger(__name__)
STOP_GRACE_S = 10.0   # how long stopping waits for the replicas before terminating them


class ReplicaError(Exception):
    """An exception raised inside a replica; `bad_input` when vLLM rejected the request."""

    def __init__(self, kind: str, message: str, bad_input: bool):
        super().__init__(f"{kind}: {message}")
        self.bad_input = bad_input


class ReplicaEngine:
    """What runs in a replica process: one vLLM engine, driven by named commands."""

    def __init__(self, settings):
        self.llm = vllm_compat.create_llm(settings)

    def generate(self, prompts: List, sampling: Dict[str, Any], seeds: List[Optional[int]],
                 stop_token_ids: List[int], logprobs: bool,
                 images: Optional[List[Optional[list]]] = None, routes: bool = False) -> List[dict]:
        """`images`: per prompt None or its PIL images (`multi_modal_data`); `routes`: each
        completion also carries its routed experts (rollout/engine.py `encode_routes`; None
        when the engine returns none)."""
        params = [vllm_compat.sampling_params(seed=seed, stop_token_ids=stop_token_ids,
                                              logprobs=logprobs, **sampling) for seed in seeds]
        inputs = vllm_compat.prompt_inputs(prompts)
        for request, pictures in zip(inputs, images or []):
            if pictures:
                request["multi_modal_data"] = {"image": pictures}
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        fields = [vllm_compat.completion_fields(out) for out in outputs]
        answers = [{"token_ids": t, "logprobs": lp, "finish_reason": r} for t, lp, r in fields]
        for answer, out in zip(answers if routes else [], outputs):
            found = vllm_compat.routed_experts(out)
            answer["routed_experts"] = None if found is None else encode_routes(found)
        return answers

    def open_communicator(self, **kwargs) -> None:
        self.llm.collective_rpc("weight_sync_open", kwargs=kwargs)

    def receive(self, specs: List[dict], src: int, last: bool) -> None:
        self.llm.collective_rpc("weight_sync_receive", args=(specs, src, last))
        if last:
            self.llm.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close_communicator(self) -> None:
        self.llm.collective_rpc("weight_sync_close")


def _replica_main(conn, cuda_devices: Optional[str]) -> None:
    """Entry point of a replica process: import vLLM's engine (seconds) while the HTTP process
    checks the flags and the model, build the engine with the settings it then sends, then serve
    commands until told to stop or the HTTP process goes away. It runs in a session of its own,
    so that a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the HTTP
    process alone, which stops the replicas in order: no KeyboardInterrupt traceback from a
    replica or from vLLM's engine processes under it."""
    os.setsid()
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    try:   # vLLM's engine, imported while the HTTP process checks the flags
        vllm_compat.import_vllm()
        from vllm import LLM  # noqa: F401
    except Exception:   # no vLLM: building the engine reports it
        pass
    try:
        name, settings = conn.recv()
    except (EOFError, OSError):
        return
    if name != "start":   # stopped before its engine was asked for
        return
    try:
        engine = ReplicaEngine(settings)
    except Exception as exc:  # reported to the HTTP process, which exits with it
        conn.send(("error", type(exc).__name__, str(exc), False))
        return
    conn.send(("ready", None))
    while True:
        try:
            name, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        if name == "shutdown":
            return
        try:
            conn.send(("ok", getattr(engine, name)(**kwargs)))
        except Exception as exc:  # a failed command must not end the replica
            logger.warning(f"replica command {name} failed: {type(exc).__name__}: {exc}")
            conn.send(("error", type(exc).__name__, str(exc), vllm_compat.is_request_error(exc)))


class Replica:
    """The HTTP process's handle on one replica process. Commands run one at a time, in order;
    `submit` returns at once (the reply is awaited in a thread that holds the replica until it
    comes), for commands that wait on the trainer's side of the communicator."""

    def __init__(self, index: int, process, conn):
        self.index, self.process, self.conn = index, process, conn
        self.lock = threading.Lock()
        # what the replica started (vLLM's TP workers), killed when it stops even if the
        # replica died first (they are then no longer its children)
        self.engine_processes: list = []

    def _gone(self) -> ReplicaError:
        return ReplicaError("ReplicaGone", f"rollout replica {self.index} exited", False)

    def _send(self, name: str, kwargs: dict) -> None:
        try:
            self.conn.send((name, kwargs))
        except OSError:
            raise self._gone() from None

    def _reply(self):
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):   # the replica process died mid-command
            raise self._gone() from None
        if reply[0] == "error":
            raise ReplicaError(*reply[1:])
        return reply[1]

    def call(self, name: str, **kwargs):
        with self.lock:
            self._send(name, kwargs)
            return self._reply()

    def submit(self, name: str, on_done: Callable[[Optional[ReplicaError]], None],
               **kwargs) -> None:
        """Send a command and return; `on_done(error or None)` runs when its reply comes, before
        the replica takes its next command."""
        self.lock.acquire()
        try:
            self._send(name, kwargs)
        except ReplicaError:
            self.lock.release()
            raise
        threading.Thread(target=self._await_reply, args=(on_done,), daemon=True).start()

    def _await_reply(self, on_done) -> None:
        try:
            error = None
            try:
                self._reply()
            except ReplicaError as exc:
                error = exc
            on_done(error)
        finally:
            self.lock.release()

    def request_stop(self) -> None:
        try:
            self.conn.send(("shutdown", {}))
        except OSError:  # the process is gone already
            pass

    def exit_reason(self) -> Optional[str]:
        """Why this replica's process has exited (its exit code or signal), or None while it
        runs."""
        code = self.process.exitcode
        if code is None:
            return None
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        return f"rollout replica {self.index} (pid {self.process.pid}) exited ({how})"


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _descendants(pid: int) -> list:
    try:
        import psutil   # installed with vLLM

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _gpu_slices(replicas: int, tp: int) -> List[Optional[str]]:
    """CUDA_VISIBLE_DEVICES of each replica (None everywhere on a machine without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return [None] * replicas
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if replicas * tp > len(ids):
        raise UserError(f"--vllm_data_parallel_size {replicas} x --vllm_tensor_parallel_size {tp} "
                        f"needs {replicas * tp} GPUs; {len(ids)} visible")
    return [",".join(ids[r * tp:(r + 1) * tp]) for r in range(replicas)]


def spawn_replicas(replicas: int, tensor_parallel_size: int) -> List[Replica]:
    """Start the replica processes, which import vLLM until start_engines hands them the engine
    settings (the caller stops them, with stop_all(grace_s=0), if it never does)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    handles = []
    try:
        for index, devices in enumerate(_gpu_slices(replicas, tensor_parallel_size)):
            parent, child = context.Pipe()
            process = context.Process(target=_replica_main, args=(child, devices),
                                      name=f"rollout-replica-{index}")
            process.start()
            handles.append(Replica(index, process, parent))
    except BaseException:
        stop_all(handles, grace_s=0)
        raise
    return handles


def start_engines(handles: List[Replica], settings) -> None:
    """Build every replica's engine and wait until all are ready (on any failure or
    interruption, SIGTERM included, the replicas are stopped)."""
    try:
        for handle in handles:
            handle._send("start", settings)
        for handle in handles:
            _wait_ready(handle)
    except BaseException:   # nothing to finish while starting: terminate at once
        stop_all(handles, grace_s=0)
        raise
    for handle in handles:
        handle.engine_processes = _descendants(handle.process.pid)


def _wait_ready(handle: Replica) -> None:
    while not handle.conn.poll(1.0):
        if not handle.process.is_alive():
            raise UserError(f"rollout replica {handle.index} exited while starting (see its "
                            "log above)")
    reply = handle.conn.recv()
    if reply[0] != "ready":
        raise UserError(f"rollout replica {handle.index} failed to start: {reply[1]}: {reply[2]}")


def stop_all(handles: List[Replica], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the replica processes within a bound: ask each to shut down, wait up to `grace_s`
    for all of them together, then SIGTERM the ones left, then SIGKILL (a wedged or stopped
    engine); finally kill what they started (vLLM's worker processes) so that nothing outlives
    us."""
    import time

    children = [c for handle in handles for c in
                handle.engine_processes or _descendants(handle.process.pid)]
    for handle in handles:
        handle.request_stop()
    deadline = time.monotonic() + grace_s
    for handle in handles:
        handle.process.join(timeout=max(deadline - time.monotonic(), 0))
    for stop, wait_s in (("terminate", 5.0), ("kill", 5.0)):
        left = [h for h in handles if h.process.is_alive()]
        if not left:
            break
        logger.warning(f"rollout replica(s) {[h.index for h in left]} did not stop: {stop}")
        for handle in left:
            getattr(handle.process, stop)()
        deadline = time.monotonic() + wait_s
        for handle in left:
            handle.process.join(timeout=max(deadline - time.monotonic(), 0))
    for child in children:
        try:
            child.kill()
        except Exception:   # gone already (psutil.NoSuchProcess) or not ours
            pass
