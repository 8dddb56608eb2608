"""A colocated generation frees the policy's DDP grad buffers (training/offload.py,
`grad_dropper`; rlhf/grpo/components.py, `offloaders`): every view stays a tensor object, the
bytes come back zeroed, nothing is copied, and --offload_model's offloader takes them instead."""
import types

import pytest
import torch

from swift_megatron.rlhf.grpo import components
from swift_megatron.training.offload import grad_dropper, model_offloader
from tests.unit.test_ms_swift_cli import rlhf


def ddp_chunk(values):
    """A module shaped as Megatron DDP is for the offloaders: `buffers` (its param-and-grad
    buffers, each with `grad_data`) and one parameter whose main_grad views the grad buffer."""
    chunk = torch.nn.Linear(2, 2, bias=False)
    grad_data = torch.tensor(values, dtype=torch.float32)
    chunk.buffers = [types.SimpleNamespace(grad_data=grad_data)]
    chunk.weight.main_grad = grad_data[:4].view(2, 2)
    return chunk


def test_grads_are_freed_and_come_back_zeroed_without_a_copy():
    chunk = ddp_chunk([1.0, -2.0, 3.0, 4.0, 5.0])
    dropper = grad_dropper([chunk])
    assert dropper.offload() == 5 * 4                      # bytes freed: the whole buffer
    assert chunk.buffers[0].grad_data.untyped_storage().nbytes() == 0
    assert dropper._host == []                              # nothing copied to host memory
    weight = chunk.weight.detach().clone()
    dropper.reload()
    assert torch.equal(chunk.buffers[0].grad_data, torch.zeros(5))
    assert torch.equal(chunk.weight.main_grad, torch.zeros(2, 2))   # the view works again
    assert torch.equal(chunk.weight, weight)                          # parameters untouched
    chunk.weight.main_grad.add_(1.5)                                  # and writes reach the buffer
    assert chunk.buffers[0].grad_data[:4].tolist() == [1.5] * 4


def test_a_chunk_without_ddp_buffers_has_nothing_to_free():
    assert grad_dropper([torch.nn.Linear(2, 2)]).offload() == 0


@pytest.mark.parametrize("offload_model", [False, True])
def test_colocate_generation_frees_the_grads_once(monkeypatch, offload_model):
    monkeypatch.setattr(components, "engine_kind", lambda args, device: "colocate")
    state = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    chunk = ddp_chunk([1.0, 2.0, 3.0, 4.0])
    pol = types.SimpleNamespace(chunks=[chunk], optimizer=None)
    args = rlhf("--offload_model", str(offload_model).lower(), "--global_batch_size", 8)
    moved = components.offloaders(args, state, pol, reference=None)
    assert [o.name for o in moved] == ["model" if offload_model else "gradients"]
    weight = chunk.weight.detach().clone()
    freed = sum(o.offload() for o in moved)
    assert freed == 4 * 4 + offload_model * weight.numel() * 4
    assert chunk.buffers[0].grad_data.untyped_storage().nbytes() == 0
    for o in moved:
        o.reload()
    assert torch.equal(chunk.buffers[0].grad_data, torch.zeros(4))
    assert torch.equal(chunk.weight, weight)


def test_server_mode_moves_nothing(monkeypatch):
    monkeypatch.setattr(components, "engine_kind", lambda args, device: "server")
    state = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    pol = types.SimpleNamespace(chunks=[ddp_chunk([1.0] * 4)], optimizer=None)
    assert components.offloaders(rlhf("--global_batch_size", 8), state, pol, None) == []


def test_model_offloader_still_drops_the_grads_it_owns():
    chunk = ddp_chunk([7.0, 8.0, 9.0, 10.0])
    offloader = model_offloader([chunk])
    offloader.offload()
    assert chunk.buffers[0].grad_data.untyped_storage().nbytes() == 0
    offloader.reload()
    assert torch.equal(chunk.buffers[0].grad_data, torch.zeros(4))
