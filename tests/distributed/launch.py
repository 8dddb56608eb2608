"""Run a worker script under torch.distributed.run on CPU (gloo) and collect its JSON results.

Each worker writes `{out_dir}/rank{RANK}.json`; `run_workers` returns those dicts by rank.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script: str, nproc: int, out_dir, args=(), timeout: int = 300):
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(WORKERS / script), "--out_dir", str(out_dir), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1",   # keeps a PYTHONPATH the packages need
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(nproc)]
