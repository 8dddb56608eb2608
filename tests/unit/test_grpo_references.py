"""Which reference model the flags choose (references.reference_source), --sync_ref_model's
mixing, ref = alpha * policy + (1 - alpha) * ref, and --offload_ref_model, on plain modules."""
import os

import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.checkpoint.sources import AdapterSource, WeightsSource
from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo.reference_source import ReferenceSource, reference_source
from swift_megatron.rlhf.grpo.references import Reference


def source(*argv, lora=False, weights=None):
    g = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *map(str, argv)],
                      "megatron rlhf").grpo
    return reference_source(g, lora, weights)


def peft_dir(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_text("")
    return str(path)


def test_which_reference(tmp_path):
    policy = WeightsSource("mcore", "/mcore")
    peft = peft_dir(tmp_path / "peft")
    assert source() == ReferenceSource(None, None)                        # a copy of the start
    assert source(weights=policy) == ReferenceSource(policy, None)
    assert source(lora=True) is None                                       # adapters disabled
    assert source("--beta", 0) is None                                     # no KL term
    assert source("--ref_model", "org/ref", lora=True) == ReferenceSource(None, None, "org/ref")
    assert source("--ref_adapters", peft, lora=True) == ReferenceSource(None, AdapterSource(peft))
    assert source("--ref_model", "org/ref", "--ref_adapters", peft) == \
        ReferenceSource(None, AdapterSource(peft), "org/ref")


def our_checkpoint(path, lora=False):
    iteration = path / "iter_0000004"
    iteration.mkdir(parents=True)
    (iteration / "swift_megatron.json").write_text("{}")
    (path / "latest_checkpointed_iteration.txt").write_text("4")
    if lora:
        peft_dir(iteration / "adapter")
    return str(iteration)


def test_mcore_reference_directories(tmp_path):
    full = our_checkpoint(tmp_path / "full")
    lora = our_checkpoint(tmp_path / "lora", lora=True)
    assert source("--mcore_ref_model", tmp_path / "full") == \
        ReferenceSource(WeightsSource("mcore", full, os.path.join(full, "hf")), None)
    base = WeightsSource("mcore", lora, os.path.join(lora, "hf"))
    assert source("--mcore_ref_adapter", tmp_path / "lora", lora=True) == \
        ReferenceSource(None, AdapterSource(os.path.join(lora, "adapter"), base=base))
    with pytest.raises(UserError, match="--mcore_ref_model .*: no such directory"):
        source("--mcore_ref_model", tmp_path / "missing")
    with pytest.raises(UserError, match="--mcore_ref_model .* is a LoRA checkpoint"):
        source("--mcore_ref_model", tmp_path / "lora")


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


def test_an_offloaded_reference_mixes_and_comes_back_bit_identical():
    torch.manual_seed(0)
    policy = torch.nn.Linear(3, 2)
    resident, offloaded = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    offloaded.load_state_dict(resident.state_dict())
    reference = Reference([offloaded], [policy], offload=True)
    assert offloaded.weight.untyped_storage().nbytes() == 0   # in host memory from the start
    Reference([resident], [policy]).mix_in_policy(0.25)
    reference.mix_in_policy(0.25)
    assert offloaded.weight.untyped_storage().nbytes() == 0   # and back there after the mix
    with reference.resident():
        for name, value in offloaded.state_dict().items():
            assert torch.equal(value, resident.state_dict()[name]), name
        with reference.resident():                             # nested: stays resident
            pass
        assert offloaded.weight.untyped_storage().nbytes() > 0
    assert offloaded.bias.untyped_storage().nbytes() == 0


def test_a_read_only_block_copies_nothing_back(monkeypatch):
    """After `resident(read_only=True)` (the reference's logprob pass, a save) the device bytes
    are dropped, the host copy kept: a write inside such a block (which breaks its contract) is
    lost, one inside a plain block is kept, and only the plain block copies to the host."""
    model = torch.nn.Linear(3, 2)
    start = model.weight.detach().clone()
    reference = Reference([model], [torch.nn.Linear(3, 2)], offload=True)
    copies = []
    real_copy = torch.Tensor.copy_
    def counted_copy(self, src, **kw):
        copies.append(self.device)
        return real_copy(self, src, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    with reference.resident(read_only=True):
        entered = len(copies)
        model.weight.data.add_(1.0)
    assert len(copies) == entered                   # nothing copied to the host
    assert model.weight.untyped_storage().nbytes() == 0
    with reference.resident():
        assert torch.equal(model.weight, start)     # the write was not copied back
        reloads = len(copies)
        model.weight.data.add_(1.0)
    assert len(copies) > reloads                    # the plain block copied to the host
    with reference.resident(read_only=True):
        assert torch.equal(model.weight, start + 1.0)


@pytest.mark.parametrize("flags", [["--beta", 0], ["--train_type", "lora"]])
def test_offload_ref_model_needs_a_reference_of_its_own(flags):
    argv = ["--model", "m", "--dataset", "d", "--offload_ref_model", "true", *map(str, flags)]
    with pytest.raises(UserError, match="--offload_ref_model true: there is no reference model"):
        parse_command(RlhfArguments, argv, "megatron rlhf")
    parse_command(RlhfArguments, argv[:-2] + ["--train_type", "lora", "--ref_model", "org/ref"],
                  "megatron rlhf")   # LoRA with a reference model of its own: allowed
