"""Which reference model the flags choose (references.reference_source) and --sync_ref_model's
mixing, ref = alpha * policy + (1 - alpha) * ref, on plain modules."""
import os

import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo.references import Reference, ReferenceSource, reference_source


def source(*argv, lora=False, weights=None):
    g = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *map(str, argv)],
                      "megatron rlhf").grpo
    return reference_source(g, lora, "/policy", weights, lambda name: f"/hub/{name}")


def test_which_reference():
    assert source() == ReferenceSource("/policy", None, None)          # a copy of the start
    assert source(weights="/mcore") == ReferenceSource("/policy", "/mcore", None)
    assert source(lora=True) is None                                     # adapters disabled
    assert source("--beta", 0) is None                                   # no KL term
    assert source("--ref_model", "org/ref", lora=True) == ReferenceSource("/hub/org/ref", None, None)
    assert source("--ref_adapters", "/peft", lora=True) == ReferenceSource("/policy", None, "/peft")
    assert source("--ref_model", "org/ref", "--ref_adapters", "/peft") == \
        ReferenceSource("/hub/org/ref", None, "/peft")


def test_mcore_reference_directories(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000004" / "adapter").mkdir(parents=True)
    (ckpt / "iter_0000004" / "swift_megatron.json").write_text("{}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    iteration = os.path.join(str(ckpt), "iter_0000004")
    assert source("--mcore_ref_model", ckpt) == \
        ReferenceSource(os.path.join(iteration, "hf"), iteration, None)
    assert source("--mcore_ref_adapter", ckpt, lora=True) == \
        ReferenceSource("/policy", None, os.path.join(iteration, "adapter"))
    with pytest.raises(UserError, match="--mcore_ref_model .*: no such directory"):
        source("--mcore_ref_model", tmp_path / "missing")


def test_sync_mixes_the_policy_into_the_reference():
    torch.manual_seed(0)
    ref, policy = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    Reference([ref], [policy]).mix_in_policy(0.25)
    for name, value in ref.state_dict().items():
        expected = 0.25 * policy.state_dict()[name] + 0.75 * before[name]
        torch.testing.assert_close(value, expected, atol=1e-7, rtol=0)
    with pytest.raises(UserError, match="--sync_ref_model needs a reference of the policy's"):
        Reference([torch.nn.Linear(3, 2, bias=False)], [policy]).mix_in_policy(0.5)
