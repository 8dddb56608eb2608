"""The frozen vision tower's per-rollout-batch cache (model/vision_cache.py) on the tiny Qwen2.5-VL
and Qwen3-VL (deepstack) fixtures, real megatron-core on CPU: one rollout batch's passes as the
trainer runs them (old-policy logprobs, reference logprobs from a frozen copy of the starting
weights, then two --num_iterations passes of training steps over two micro-batches of two
completions of one image prompt each) give the same logprobs, losses and gradients with the
cache as without, while the tower runs once per image instead of once per micro-batch and pass;
an unfrozen tower gets no cache, runs in every pass and gets gradients; towers share a cache only
when equal, and only frozen ones without dropout get one."""
from contextlib import nullcontext
from functools import partial

import pytest
import torch

from swift_megatron.model.vision import VISUAL, freeze
from swift_megatron.model.vision_cache import cacheable, frozen_tower_cache, same_tower
from swift_megatron.training.offload import model_offloader
from swift_megatron.rlhf.grpo.batch import Sample, split_micro_batches
from swift_megatron.rlhf.grpo.objective import (LossSettings, StepConstants, collect_logprobs,
                                                grpo_loss)
from swift_megatron.training.step import contribution_scale, forward_backward

GRID = (1, 4, 4)   # 16 patches, 4 image tokens each
ITERATIONS = 2


@pytest.fixture
def cpu_state():
    from swift_megatron.parallel.state import ParallelState

    yield ParallelState.initialize(device="cpu", seed=0)
    ParallelState.destroy()


def _load(hf_dir, state, freeze_vit: bool):
    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.model.config import load_hf_config

    hf_config = load_hf_config(hf_dir)
    loaded = load_mcore_model(hf_config, hf_config["model_type"], torch.float32, state,
                              hf_dir=hf_dir)
    freeze(loaded.model, freeze_llm=False, freeze_vit=freeze_vit, freeze_aligner=freeze_vit)
    return hf_config, loaded


def _samples(hf_config) -> list:
    """Two prompts (groups) with one image each, two completions per prompt."""
    from swift_megatron.data.images import mrope_position_ids

    gen = torch.Generator().manual_seed(0)
    start, pad = hf_config["vision_start_token_id"], hf_config["image_token_id"]
    vision = hf_config["vision_config"]
    width = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    grid = torch.tensor([GRID])
    samples = []
    for group in range(2):
        prompt = [5 + group, start] + [pad] * (GRID[1] * GRID[2] // 4) + \
                 [hf_config["vision_end_token_id"], 7, 8]
        positions = mrope_position_ids(hf_config, torch.tensor([prompt]), pad, grid)[:, 0]
        pixels = torch.randn(GRID[1] * GRID[2], width, generator=gen)
        for k in range(2):
            completion = torch.randint(10, 100, (3 + 2 * k,), generator=gen).tolist()
            samples.append(Sample(group_id=group, prompt_id=group, prompt_ids=prompt,
                                  completion_ids=completion, rollout_logprobs=None,
                                  finish_reason="stop", rewards=[], advantage=1.0 - 1.5 * k,
                                  pixel_values=pixels, image_grid_thw=grid,
                                  prompt_positions=positions))
    return samples


def _rollout_batch(hf_dir, state, packed: bool, cached: bool, freeze_vit: bool = True):
    """One rollout batch's passes; returns (results, tower calls, images through the tower,
    the policy's tower)."""
    hf_config, policy = _load(hf_dir, state, freeze_vit)
    _, reference = _load(hf_dir, state, True)
    calls = []
    for loaded in (policy, reference):
        getattr(loaded.model, VISUAL).register_forward_hook(
            lambda module, args, kwargs, out: calls.append(len(kwargs["grid_thw"])),
            with_kwargs=True)
    micro = split_micro_batches(_samples(hf_config), 2, pad_id=0, packed=packed)
    settings = LossSettings(loss_type="grpo", beta=0.1, epsilon=0.2, epsilon_high=0.2,
                            delta=None, importance_sampling_level="token", temperature=1.0,
                            max_completion_length=8, vocab_size=policy.shape.vocab_size)
    constants = StepConstants(num_sequences=4,
                              num_tokens=float(sum(mb["completion_mask"].sum() for mb in micro)),
                              num_micro_batches=2, contribution_scale=contribution_scale(2, 1))
    collect = partial(collect_logprobs, settings)
    results = {}
    model = policy.model
    with frozen_tower_cache([model], [reference.model]) if cached else nullcontext():
        for mb, old, ref in zip(micro, forward_backward([model], micro, collect, True),
                                forward_backward([reference.model], micro, collect, True)):
            mb["old_logprobs"], mb["ref_logprobs"] = old["logprobs"], ref["logprobs"]
        for it in range(ITERATIONS):
            model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                outputs = forward_backward([model], micro, partial(grpo_loss, settings, constants))
            results[f"loss{it}"] = torch.stack([out["loss"] for out in outputs])
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.update({f"{n}@{it}": g for n, g in grads.items()})
            with torch.no_grad():   # a plain SGD step: the second pass sees other weights
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(1e-2 * p.grad)
    for i, mb in enumerate(micro):
        results[f"old{i}"], results[f"ref{i}"] = mb["old_logprobs"], mb["ref_logprobs"]
    return results, len(calls), sum(calls), getattr(model, VISUAL)


@pytest.mark.parametrize("family,packed", [("qwen2_5_vl", False), ("qwen2_5_vl", True),
                                           ("qwen3_vl", False), ("qwen3_vl", True)])
def test_cache_gives_the_same_step_with_one_tower_run_per_image(tiny_model_dir, cpu_state,
                                                                family, packed):
    hf_dir = tiny_model_dir(family)
    plain, plain_calls, plain_images, _ = _rollout_batch(hf_dir, cpu_state, packed, False)
    cached, calls, images, _ = _rollout_batch(hf_dir, cpu_state, packed, True)
    # without: every pass runs the tower on each micro-batch's images (2 micro-batches x (old +
    # ref + 2 training passes)); with: each prompt's image once (the reference's tower holds
    # the policy's frozen tensors, so they share it; a group's two completions share theirs)
    assert (plain_calls, plain_images) == (8, 16)
    assert (calls, images) == (2, 2)
    assert plain.keys() == cached.keys() and any("@" in k and "embedding" in k for k in plain)
    worst = max(float((plain[k] - cached[k]).abs().max()) for k in plain)
    assert worst <= 1e-6, worst   # measured: 0.0 (bit for bit) on CPU
    assert float(plain["loss0"].abs().sum()) > 0 and not torch.equal(plain["loss0"],
                                                                      plain["loss1"])


def test_an_unfrozen_tower_runs_in_every_pass_and_trains(tiny_model_dir, cpu_state):
    results, calls, images, visual = _rollout_batch(tiny_model_dir("qwen3_vl"), cpu_state,
                                                    True, True, freeze_vit=False)
    # the policy's tower: 2 micro-batches x (old + 2 training passes), 2 images each; the
    # frozen reference's own cached tower: each prompt's image once
    assert (calls, images) == (8, 14)
    tower = [k for k in results if k.startswith(f"{VISUAL}.") and k.endswith("@0")]
    assert any("blocks" in k for k in tower) and any("deepstack_merger" in k for k in tower)
    assert all(float(results[k].abs().max()) > 0 for k in tower)


def test_towers_are_shared_only_when_equal():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert same_tower(a, a) and not same_tower(a, b)
    b.load_state_dict(a.state_dict())
    assert same_tower(a, b)
    b.weight.data[0, 0] += 1e-3
    assert not same_tower(a, b)
    b.load_state_dict(a.state_dict())
    offloader = model_offloader([b])      # --offload_ref_model: b's bytes in host memory
    offloader.offload()
    assert not same_tower(a, b) and not same_tower(b, a)
    offloader.reload()
    assert same_tower(a, b)


def test_only_frozen_towers_without_dropout_are_cached():
    tower = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
    assert not cacheable(tower)   # trains
    tower.requires_grad_(False)
    assert cacheable(tower)
    tower[1].p = 0.1
    assert not cacheable(tower)
    tower[1].p, tower[0].attention_dropout = 0.0, 0.1   # transformers' attention modules
    assert not cacheable(tower)
