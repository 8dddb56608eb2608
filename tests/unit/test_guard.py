"""The non-finite guard's pieces (training/guard.py): skipped updates counted and stopped after
--max_skipped_steps in a row, and weights checked before a save. The skip itself, on a real
megatron optimizer, is tests/e2e/test_rlhf_e2e.py::test_non_finite_updates_are_skipped_then_stop."""
import pytest
import torch

from swift_megatron.errors import NonFiniteError, UserError
from swift_megatron.training.guard import SkipGuard, check_finite_weights


def test_skips_in_a_row_stop_the_run():
    guard = SkipGuard(limit=3)
    assert guard.update(True, 0.5, 1) is None
    assert "update skipped (1 in a row" in guard.update(False, float("nan"), 2)
    assert guard.update(True, 0.4, 3) is None              # an applied update resets the count
    guard.update(False, float("inf"), 4)
    guard.update(False, float("nan"), 5)
    with pytest.raises(NonFiniteError, match=r"step 6: .* 3 optimizer steps in a row "
                                             r"\(--max_skipped_steps 3\)"):
        guard.update(False, float("nan"), 6)
    assert issubclass(NonFiniteError, UserError)           # exit code 2, no traceback


def test_limit_zero_never_stops():
    guard = SkipGuard(limit=0)
    for step in range(10):
        assert "skipped" in guard.update(False, float("nan"), step)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_not_saved(bad):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    check_finite_weights([model], "checkpoint of step 4")
    with torch.no_grad():
        model[1].weight[0, 2] = bad
    with pytest.raises(NonFiniteError, match="checkpoint of step 4: .* NaN or inf: not saved"):
        check_finite_weights([model], "checkpoint of step 4")
