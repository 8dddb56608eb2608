"""The code paths a GPU run takes by default, run on the CPU (platform/cuda_paths.py `on_cpu()`)
against the CPU's own defaults, so that a GPU-only breakage of them fails CI: the compiled layer
nodes (RMSNorm, SwiGLU, packed RoPE) and the compiled logprob math of the chunked head, through
Inductor's C++ backend; torch's fused Adam; the grad dropper and the offloaders' device
synchronisation.

Per model family (every fixture family, and Qwen3.5 with images): one GRPO micro-step as the
trainer runs it, the policy built by rlhf/grpo/components.py (Megatron DDP, megatron's optimizer)
from the tiny checkpoint, two packed micro-batches, the logprob chunks small enough that the head
runs several chunks and vocabulary blocks: the old-policy logprobs, the gradients freed and
restored as around a colocated generation, the GRPO loss's forward and backward, an optimizer
step. The CUDA paths give the CPU defaults' logprobs, losses, gradients and weight updates in
float32 (within Inductor's rounding), every compiled group compiled without falling back to its
eager functions, and each family's own functions (its norm kind, SwiGLU where it has a dense MLP,
RoPE, the head's math) ran compiled. The compiled functions are shared by the tests of a process
(the groups compile once per shape and keep their kernels across `on_cpu()` blocks).

Qwen3.5's stack once failed on CUDA with the defaults: its Gated DeltaNet's gated norm, which
megatron-core compiles itself (`jit_fuser`), called our compiled norm, and dynamo refused its own
`maybe_mark_dynamic` inside traced code (model/compiled.py `Compiled.run`); the qwen3_5 cases
here fail the same way without that fix.
"""
from functools import partial

import pytest
import torch

from swift_megatron.model import activations, grouped_experts, logprobs, rope
from swift_megatron.model.compiled import Compiled
from swift_megatron.platform import cuda_paths
from swift_megatron.training.offload import grad_dropper, model_offloader

GROUPS = (activations.MATH, rope.MATH, logprobs.KERNELS, grouped_experts.MATH)
HEAD = {"chunk_stats", "logprob_grad"}
DENSE = {"swiglu", "swiglu_grad"}
GROUPED = {"weighted_swiglu", "weighted_swiglu_grad"}   # the grouped experts' (model/grouped_experts.py)
FAMILIES = {   # family (images) -> its compiled functions besides RoPE's and the head's
    "llama": {"rms_norm", "rms_norm_grad"} | DENSE,
    "qwen2": {"rms_norm", "rms_norm_grad"} | DENSE,
    "qwen3": {"rms_norm", "rms_norm_grad"} | DENSE,
    "qwen3_moe": {"rms_norm", "rms_norm_grad"} | GROUPED,
    "qwen3_5": {"zero_centered_rms_norm", "zero_centered_rms_norm_grad"} | DENSE,
    "qwen3_5_moe": {"zero_centered_rms_norm", "zero_centered_rms_norm_grad"} | GROUPED,
    "qwen2_5_vl": {"rms_norm", "rms_norm_grad"} | DENSE,
    "qwen3_vl": {"rms_norm", "rms_norm_grad"} | DENSE,
    "qwen3_5_images": {"zero_centered_rms_norm", "zero_centered_rms_norm_grad"} | DENSE,
}


def test_the_cpu_takes_the_cuda_paths_inside_on_cpu_only():
    group = Compiled("test kernels", "SWIFT_MEGATRON_TEST_UNUSED", f=torch.neg)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not cuda_paths.takes_cuda_paths(cpu) and not group.active(cpu)
    with cuda_paths.on_cpu():
        assert cuda_paths.takes_cuda_paths(cpu) and group.active(cpu)
        assert not cuda_paths.takes_cuda_paths(torch.device("meta"))
    assert cuda_paths.takes_cuda_paths(cuda) and not cuda_paths.takes_cuda_paths(cpu)


def _storages(offloader_kind):
    """A DDP-shaped chunk (tests/unit/test_offload_grads.py) and the storages `offloader_kind`
    frees: its grad buffer, and with the model offloader its weight too."""
    from tests.unit.test_offload_grads import ddp_chunk

    chunk = ddp_chunk([1.0, -2.0, 3.0, 4.0])
    grads = chunk.buffers[0].grad_data.untyped_storage()
    moved = [grads] if offloader_kind is grad_dropper else [grads, chunk.weight.untyped_storage()]
    return chunk, moved


@pytest.mark.parametrize("offloader_kind", [grad_dropper, model_offloader])
def test_offloaders_synchronise_before_freeing_and_after_restoring(monkeypatch, offloader_kind):
    """Where the CUDA paths are taken the offloader waits for the device before a storage is
    freed (no kernel may still read it, nor a copy to the host still be in flight) and after its
    bytes are restored: on the CPU the wait is torch.cpu.synchronize, recorded here with the
    storages' sizes at that moment. (A drop-only offload once freed without waiting.)"""
    chunk, moved = _storages(offloader_kind)
    seen = []
    monkeypatch.setattr(torch.cpu, "synchronize",
                        lambda device=None: seen.append([s.nbytes() for s in moved]))
    offloader = offloader_kind([chunk])
    sizes = [s.nbytes() for s in moved]
    with cuda_paths.on_cpu():
        offloader.offload()
        assert seen == [sizes] and all(s.nbytes() == 0 for s in moved)
        offloader.reload()
    assert seen == [sizes, sizes]
    offloader.offload()   # off the CUDA paths the CPU has nothing to wait for
    offloader.reload()
    assert len(seen) == 2


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    """family -> tiny checkpoint; qwen3_5_images: Qwen3.5 with its vision tokens and processor."""
    from swift_megatron.fixtures import build_tiny_model

    images = str(tmp_path_factory.mktemp("qwen3_5_images") / "model")
    return lambda family: (build_tiny_model("qwen3_5", images, images=True)
                           if family == "qwen3_5_images" else tiny_model_dir(family))


@pytest.fixture
def cpu_state():
    from swift_megatron.parallel.state import ParallelState

    yield ParallelState.initialize(device="cpu", seed=0)
    ParallelState.destroy()


def _samples(model_dir: str, hf_config: dict) -> list:
    """Four completions of two prompts: test_vision_cache's image prompts where the model takes
    images, else text prompts of random tokens."""
    from swift_megatron.model.vision import takes_images
    from swift_megatron.rlhf.grpo.batch import Sample
    from tests.unit.test_vision_cache import _samples as image_samples

    if takes_images(model_dir, hf_config):
        return image_samples(hf_config)
    gen = torch.Generator().manual_seed(0)
    return [Sample(group_id=g, prompt_id=g, rollout_logprobs=None, finish_reason="stop",
                   prompt_ids=torch.randint(10, 400, (6 + g,), generator=gen).tolist(),
                   completion_ids=torch.randint(10, 400, (5 + 3 * k,), generator=gen).tolist(),
                   rewards=[], advantage=1.0 - 1.5 * k) for g in range(2) for k in range(2)]


def _grpo_micro_step(model_dir: str, state) -> dict:
    """One rollout batch's passes on the policy components.py builds (module docstring):
    {name: tensor} of the logprobs, losses, gradients and updated weights."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.checkpoint.start import Start
    from swift_megatron.rlhf.grpo import components
    from swift_megatron.rlhf.grpo.batch import split_micro_batches
    from swift_megatron.rlhf.grpo.objective import StepConstants, collect_logprobs, grpo_loss
    from swift_megatron.training.optim import torch_optimizers
    from swift_megatron.training.step import (contribution_scale, forward_backward,
                                              optimizer_step, zero_grads)

    # Adam's first step is about lr * sign(gradient), which a rounding flips where a gradient is
    # near 0; with eps 1 it is lr * g / (|g| + 1): an update as exact as the gradient
    args = parse_command(RlhfArguments, ["--model", model_dir, "--dataset", "unused", "--lr", "1",
                                         "--adam_eps", "1", "--beta", "0.04"], "megatron rlhf")
    pol = components.policy(args, state, model_dir, 1, Start(None, None, None))
    settings = components.loss_settings(args, pol)
    micro = split_micro_batches(_samples(model_dir, pol.hf_config), 2, pad_id=0, packed=True)
    results = {}
    for i, (mb, out) in enumerate(zip(micro, forward_backward(pol.chunks, micro, partial(
            collect_logprobs, settings), True))):
        mb["old_logprobs"] = mb["ref_logprobs"] = results[f"old{i}"] = out["logprobs"]
    dropper = grad_dropper(pol.chunks)   # as around a colocated generation
    assert dropper.offload() > 0
    dropper.reload()
    constants = StepConstants(num_sequences=4, num_tokens=float(sum(
        mb["completion_mask"].sum() for mb in micro)), num_micro_batches=2,
        contribution_scale=contribution_scale(2, 1))
    zero_grads(pol.chunks, pol.optimizer)
    outputs = forward_backward(pol.chunks, micro, partial(grpo_loss, settings, constants))
    results["loss"] = torch.stack([out["loss"] for out in outputs])
    [model] = [chunk.module for chunk in pol.chunks]
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    results.update({f"grad {n}": p.main_grad.clone() for n, p in params})
    before = {n: p.detach().clone() for n, p in params}
    assert optimizer_step(pol.optimizer, pol.scheduler)[0]
    results.update({f"update {n}": p.detach() - before[n] for n, p in params})
    results["fused"] = torch.tensor([group.get("fused") is True for opt in
                                     torch_optimizers(pol.optimizer) for group in opt.param_groups])
    return results


def _compiled_calls(monkeypatch) -> set:
    """The names of the group functions that run compiled from now on (a spy on Compiled.run)."""
    calls, run = set(), Compiled.run

    def spy(self, name, device, *args):
        if self.active(device) and not torch.compiler.is_compiling():
            calls.add(name)
        return run(self, name, device, *args)

    monkeypatch.setattr(Compiled, "run", spy)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_paths_give_the_cpu_defaults_grpo_step(family, model_dirs, cpu_state, monkeypatch):
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 4 * 512 * 8)   # 8 tokens a chunk, ~5 blocks
    model_dir = model_dirs(family)
    default = _grpo_micro_step(model_dir, cpu_state)
    calls = _compiled_calls(monkeypatch)
    with cuda_paths.on_cpu():
        cuda = _grpo_micro_step(model_dir, cpu_state)
    assert not any(group.failed for group in GROUPS), [g.what for g in GROUPS if g.failed]
    assert calls == FAMILIES[family] | {"rotate", "rotate_grad"} | HEAD
    assert not default.pop("fused").any() and cuda.pop("fused").all()
    assert default.keys() == cuda.keys()
    for name, want in default.items():
        torch.testing.assert_close(cuda[name], want, rtol=1e-4, atol=1e-5, msg=name)
    assert default["loss"].abs().sum() > 0
    assert all(default[name].abs().sum() > 0 for name in default if name.startswith("grad "))
