"""Packed (THD, --padding_free) micro-batches compute exactly what padded ones do: the GRPO loss,
its metrics, every gradient and the logprobs, for completions of very different lengths, on a
dense and a MoE tiny model, at TP=1 and at TP=2 with sequence parallelism, and a hybrid Gated
DeltaNet (qwen3_5) model at TP=1; micro-batches formed
by a token budget (--max_tokens_per_micro_batch) give the same step loss and gradients
(tests/distributed/workers/packed_vs_padded.py)."""
import pytest
import torch

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    tp = request.param
    return run_workers("packed_vs_padded.py", tp, tmp_path_factory.mktemp(f"packed{tp}"),
                       ["--tp", tp])


# Gated DeltaNet takes packed sequences only without sequence parallelism (refused up front:
# tests/unit/test_dry_run.py), so the hybrid model runs at TP=1 only.
@pytest.mark.parametrize("ranks,model", [(1, "dense"), (1, "moe"), (1, "hybrid"), (2, "dense"),
                                         (2, "moe")], indirect=["ranks"],
                         ids=["tp1-dense", "tp1-moe", "tp1-hybrid", "tp2_sp-dense", "tp2_sp-moe"])
def test_packed_equals_padded(ranks, model):
    for rank in ranks:
        padded, packed = rank[model]["padded"], rank[model]["packed"]
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-7)
        assert packed["entropy"] == pytest.approx(padded["entropy"], rel=1e-5)
        assert packed["clip"] == pytest.approx(padded["clip"], abs=1e-6)
        assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
        for name, grad in padded["grads"].items():
            assert torch.tensor(packed["grads"][name]) == pytest.approx(torch.tensor(grad),
                                                                         abs=1e-6), name
        for mine, ref in zip(packed["logprobs"], padded["logprobs"]):
            assert torch.tensor(mine) == pytest.approx(torch.tensor(ref), abs=1e-5)
        assert padded["grad_norm"] > 0 and padded["loss"] != 0  # the step really did something


@pytest.mark.parametrize("ranks,model", [(1, "dense"), (1, "moe"), (2, "dense"), (2, "moe")],
                         indirect=["ranks"], ids=["tp1-dense", "tp1-moe", "tp2_sp-dense", "tp2_sp-moe"])
def test_token_budget_gives_the_same_step(ranks, model):
    for rank in ranks:
        padded, budget = rank[model]["padded"], rank[model]["budget"]
        assert budget["micro_batches"] != padded["micro_batches"]  # really a different split
        assert budget["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-7)
        assert budget["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
