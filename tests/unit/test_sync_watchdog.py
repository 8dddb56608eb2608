"""The weight-sync watchdog (rollout/watchdog.py, --weight_sync_timeout): a sync that stalls past
the timeout ends the run with a message naming the step, the bucket and the rollout server; a
sync within it, or a timeout of 0, passes untouched; the real exit prints the message and ends
the process with exit 1 even while its main thread is stuck; and the flag's server-mode rule."""
import subprocess
import sys
import threading
import time

import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.rollout.watchdog import Watchdog

pytestmark = pytest.mark.quick


def test_a_stall_past_the_timeout_is_reported_once():
    stalls = []
    dog = Watchdog(0.05, stalls.append)
    with dog.watch(lambda: "the weight sync after step 3: loading"):
        time.sleep(0.3)
    assert len(stalls) == 1
    assert stalls[0].startswith("the weight sync after step 3: loading stalled for more than "
                                "0.05 s (--weight_sync_timeout")


@pytest.mark.parametrize("timeout", [0, 5.0])
def test_a_quick_sync_or_no_limit_passes(timeout):
    stalls = []
    with Watchdog(timeout, stalls.append).watch(lambda: "x"):
        time.sleep(0.05)
    assert stalls == [] and threading.active_count() < 50


class Server:
    def __init__(self, address):
        self.address, self.sent = address, []

    def request(self, path, body, idempotent=True):
        self.sent.append(path)


class StuckComm:
    """Receives bucket 0, then blocks on bucket 1 (a replica that died mid-sync)."""
    device = torch.device("cpu")

    def __init__(self):
        self.calls, self.release = 0, threading.Event()

    def broadcast(self, tensor, src):
        self.calls += 1
        if self.calls == 2:
            self.release.wait(5)


def test_the_server_engine_names_the_bucket_and_the_server():
    from swift_megatron.rollout.client import ServerEngine

    engine = ServerEngine.__new__(ServerEngine)
    comm = StuckComm()
    engine.rank, engine.bucket_bytes, engine.weight_version = 0, 64, 0
    engine.servers, engine.communicators = [Server("http://10.0.0.5:8000")], [(comm, 1, "t", {})]
    stalls = []

    def on_stall(message):
        stalls.append(message)
        comm.release.set()

    tensors = [(f"model.layers.{i}.mlp.weight", torch.zeros(16)) for i in range(4)]  # 64 B each
    with Watchdog(0.1, on_stall).watch(lambda: f"the weight sync after step 7: "
                                               f"{engine.sync_position}"):
        engine.update_weights(iter(tensors))
    assert stalls and stalls[0].startswith(
        "the weight sync after step 7: broadcasting bucket 1 (1 tensors, model.layers.1.mlp.weight"
        " .. model.layers.1.mlp.weight) to rollout server http://10.0.0.5:8000's replicas stalled "
        "for more than 0.1 s")


def test_the_real_exit_ends_a_stuck_process_with_exit_1():
    script = ("import time\nfrom swift_megatron.rollout.watchdog import Watchdog\n"
              "with Watchdog(0.2).watch(lambda: 'the weight sync after step 3: broadcasting "
              "bucket 0'):\n    time.sleep(60)\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 30
    assert "error: the weight sync after step 3: broadcasting bucket 0 stalled for more than " \
           "0.2 s" in proc.stderr and "Traceback" not in proc.stderr


def rollout_args(*argv):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *argv],
                         "megatron rlhf").rollout


def test_the_flag_default_and_server_mode_rule():
    assert rollout_args().weight_sync_timeout == 600
    assert rollout_args("--vllm_mode", "server").weight_sync_timeout == 840   # 600 + 240
    assert rollout_args("--vllm_mode", "server", "--weight_sync_timeout", "0") \
        .weight_sync_timeout == 0
    with pytest.raises(UserError, match="--weight_sync_timeout 100 must exceed "
                                        "--vllm_server_timeout 240 in server mode"):
        rollout_args("--vllm_mode", "server", "--weight_sync_timeout", "100")
