"""Multi-turn rollouts on 2 ranks whose episodes end after different numbers of turns: every
rank joins every engine call (the ranks agree on another turn by all-reduce), a rank whose
episodes are done joins with no requests, and the multi_turn/ metrics cover both ranks
(tests/distributed/workers/multi_turn_collective.py)."""
import pytest

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


def test_ranks_with_different_turn_counts_make_the_same_engine_calls(tmp_path):
    ranks = run_workers("multi_turn_collective.py", 2, tmp_path)
    for rank in ranks:
        assert rank["calls"] == [[2, 2], [0, 2], [0, 2]]   # requests per rank, per call
        assert rank["metrics"]["multi_turn/num_turns_mean"] == 2.0   # (1 + 3) / 2
        assert rank["metrics"]["multi_turn/num_turns_max"] == 3.0
        assert rank["metrics"]["multi_turn/turn_3_reward_mean"] == 1.0
    assert ranks[0]["turns"] == [1, 1] and ranks[1]["turns"] == [3, 3]
    assert set(ranks[0]["masks"][0]) == {1}
    assert ranks[1]["masks"][0].count(0) > 0   # the "again" messages, masked
