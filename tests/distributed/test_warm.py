"""tests/distributed/warm.py: which commands fork from the warm process, and a launch of N ranks
as N forked children: torchrun's variables, one process group, and a failing rank that stops the
others with the launcher's exit code."""
import os
import sys
import time

from tests.distributed import warm
from tests.distributed.launch import free_port, run_workers

CLI = [sys.executable, "-m", "swift_megatron.cli.main"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_what_forks():
    env = dict(os.environ)
    assert warm.parse([*CLI, "rlhf", "--model", "m"], env) == \
        warm.Launch("cli", ["rlhf", "--model", "m"], 1, "29500", torchrun=False)
    ranks = warm.parse([*CLI, "export"], dict(env, NPROC_PER_NODE="2", MASTER_PORT="123"))
    assert (ranks.nproc, ranks.master_port, ranks.torchrun) == (2, "123", True)
    script = [*TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1", "--master_port=7", "w.py"]
    assert warm.parse([*script, "--x", "1"], env) == \
        warm.Launch("w.py", ["--x", "1"], 2, "7", torchrun=True)
    server = [*CLI, "rlhf", "--model", "/vllm_model", "--vllm_mode", "server"]   # engines elsewhere
    assert warm.parse(server, dict(env, SWIFT_MEGATRON_ROLLOUT_API_KEY="k")).argv == server[3:]
    for cmd, extra in [([*CLI, "rlhf", "--use_vllm", "true"], {}),         # vLLM: a real process
                       ([*CLI, "rlhf", "--vllm_mode", "colocate"], {}),
                       ([*CLI, "rlhf", "--model", "/vllm_model"], {}),
                       ([*CLI, "rlhf", "--config", "c.yaml"], {}),
                       ([*CLI, "rollout"], {}),
                       ([*CLI, "rlhf"], {"NPROC_PER_NODE": "auto"}),
                       ([*CLI, "rlhf"], {"NNODES": "2"}),                  # several nodes
                       ([*TORCHRUN, "--nnodes=2", *script[3:]], {}),
                       ([*CLI, "rlhf"], {"SOME_SETTING": "1"})]:          # another environment
        assert warm.parse(cmd, dict(env, **extra)) is None, (cmd, extra)


def test_ranks_get_torchrun_variables_and_one_group(tmp_path):
    ranks = run_workers("ranks_probe.py", 2, tmp_path)
    assert [r["RANK"] for r in ranks] == [r["LOCAL_RANK"] for r in ranks] == ["0", "1"]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["MASTER_ADDR"]) for r in ranks} == \
        {("2", "2", "127.0.0.1")}
    assert [r["total"] for r in ranks] == [3.0, 3.0]   # 1 + 2 over the group


def test_a_failing_rank_stops_the_others(tmp_path):
    cmd = [*TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}",
           os.path.join(os.path.dirname(__file__), "workers", "ranks_probe.py"),
           "--out_dir", str(tmp_path), "--fail_rank", "1"]
    env = dict(warm._server.get("env", os.environ))   # the warm process's own environment
    assert warm.forkable(cmd, env)
    began = time.monotonic()
    ranks = warm.start(cmd, env, os.getcwd(), str(tmp_path / "out"), str(tmp_path / "err"))
    try:
        assert ranks.wait(timeout=120) == 3   # rank 1's own code; rank 0, killed, does not count
    finally:
        ranks.kill()
    assert time.monotonic() - began < 60  # rank 0 did not wait out gloo's timeout
    assert not list(tmp_path.glob("rank*.json"))
