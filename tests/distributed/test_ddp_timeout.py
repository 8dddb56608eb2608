"""--ddp_timeout reaches every process group of a run (workers/ddp_timeout.py: PP=2 over 2
processes, the groups started from the parsed flags): the world, megatron's groups, ours, and
one made afterwards as vLLM's colocated engine and the rollout client make theirs."""
import pytest

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


def test_the_timeout_reaches_every_group(tmp_path):
    ranks = run_workers("ddp_timeout.py", 2, tmp_path, ["--ddp_timeout", 1234])
    for rank in ranks:
        assert {"world", "replica", "later", "data_parallel", "pipeline_model_parallel",
                "embedding"} <= set(rank)
        assert set(rank.values()) == {1234.0}, rank
    assert "position_embedding" in ranks[0]   # the first stage's group: rank 0 only
