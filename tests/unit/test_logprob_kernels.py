"""The logprob chunk math's compile fallback: when torch.compile's kernels fail (no Triton, an
Inductor bug), the run warns once and the eager functions compute the same numbers from then on;
an eager failure is not swallowed."""
import pytest
import torch

from swift_megatron.model import logprobs


def _inputs():
    torch.manual_seed(0)
    logits = (torch.randn(4, 11) * 3).bfloat16()
    return logits, torch.tensor([0, 3, 10, 7]), torch.tensor([True, True, False, True])


def _broken(*_):
    raise RuntimeError("inductor exploded")


def test_failed_compile_warns_and_falls_back_to_eager(monkeypatch):
    monkeypatch.setattr(logprobs, "COMPILE", True)
    monkeypatch.setattr(logprobs._Kernels, "compiled", (_broken, _broken))
    warnings = []   # the package logger may not propagate to pytest's capture (setup_logging)
    monkeypatch.setattr(logprobs.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    logits, column, mine = _inputs()
    lse, picked, _ = logprobs._Kernels.run(0, logits.device, logits, column, mine, 0.7, 9, False)
    assert len(warnings) == 1 and "torch.compile of the logprob kernels failed" in warnings[0]
    assert logprobs._Kernels.compiled is logprobs.EAGER
    scaled = logits.float()[:, :9] / 0.7
    assert lse == pytest.approx(torch.logsumexp(scaled, -1), abs=1e-5)
    assert picked.tolist()[:2] == pytest.approx([scaled[0, 0].item(), scaled[1, 3].item()])
    assert picked[2] == 0   # target in another shard


def test_eager_failure_is_raised(monkeypatch):
    monkeypatch.setattr(logprobs, "COMPILE", False)
    monkeypatch.setattr(logprobs, "EAGER", (_broken, _broken))
    logits, column, mine = _inputs()
    with pytest.raises(RuntimeError, match="exploded"):
        logprobs._Kernels.run(0, logits.device, logits, column, mine, 1.0, 11, False)
