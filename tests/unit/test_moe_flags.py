"""ms-swift's MoE flags (arguments/moe.py): their defaults are ms-swift's, their values reach
megatron-core's TransformerConfig through the code the trainer runs (components.py), every
value that cannot work is refused before anything loads, and on the tiny qwen3_moe (real
megatron-core on CPU, two micro-batches through megatron's schedule):

- a load-balancing loss coefficient c changes the last layer's router gradient by exactly
  c / micro-batches x the gradient of the Switch-Transformer loss E x sum_e f_e P_e of that
  layer's router inputs (recomputed here from the documented formula), and logs that loss as
  moe/load_balancing_loss (mean over layers and micro-batches); likewise the z-loss
  (mean squared log-sum-exp of the router logits) and moe/z_loss;
- --moe_router_dtype fp64 routes in float64, --moe_shared_expert_overlap (tiny qwen3_5_moe)
  gives the same logits and gradients as the shared expert run before the router.
"""
import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.moe import check_moe_flags
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError

# ms-swift's `# moe` group (swift/megatron/arguments/megatron_args.py) and the values its
# model config gives the Qwen MoE families (mcore-bridge's ModelConfig)
MS_SWIFT_DEFAULTS = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                         moe_z_loss_coeff=None, moe_router_dtype="fp32",
                         moe_shared_expert_overlap=False, moe_pad_expert_input_to_capacity=False,
                         moe_token_drop_policy="probs")


def flags(*extra, model="unused") -> RlhfArguments:
    return parse_command(RlhfArguments, ["--model", model, "--dataset", "unused", *extra],
                         "megatron rlhf")


def test_defaults_are_ms_swifts():
    args = flags()
    assert args.moe.config_overrides() == MS_SWIFT_DEFAULTS
    assert args.moe.router_replay_mode == "disabled"
    assert args.moe.moe_expert_capacity_factor is None


def test_list_forms_and_values_reach_the_overrides():
    moe = flags("--moe_router_load_balancing_type", "seq_aux_loss", "global_aux_loss",
                "--moe_aux_loss_coeff", "1e-3", "1e-4", "--moe_z_loss_coeff", "1e-3",
                "--moe_router_dtype", "none", "--moe_expert_capacity_factor", "1.5",
                "--moe_pad_expert_input_to_capacity", "true",
                "--moe_token_drop_policy", "position").moe
    assert moe.config_overrides() == dict(
        MS_SWIFT_DEFAULTS, moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[1e-3, 1e-4], moe_z_loss_coeff=1e-3, moe_router_dtype=None,
        moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
        moe_token_drop_policy="position")
    assert flags("--moe_router_load_balancing_type", "none").moe.config_overrides()[
        "moe_router_load_balancing_type"] == "none"    # the parser's none word is the type


@pytest.mark.parametrize("extra,message", [
    (["--moe_aux_loss_coeff", "0.1", "--moe_router_load_balancing_type", "none"],
     "a coefficient applies to aux_loss, seq_aux_loss, global_aux_loss only"),
    (["--moe_aux_loss_coeff", "0.1", "--moe_router_load_balancing_type", "sinkhorn"],
     "a coefficient applies to"),
    (["--moe_router_load_balancing_type", "aux_loss", "seq_aux_loss"],
     "give one --moe_aux_loss_coeff per type"),
    (["--moe_aux_loss_coeff", "0.1", "0.2", "0.3", "--moe_router_load_balancing_type",
      "aux_loss", "z"], "invalid choice 'z'"),
    (["--moe_aux_loss_coeff", "0.1", "0.2"], "gives 2 coefficients for 1"),
    (["--moe_aux_loss_coeff", "-1"], "must be one or more numbers >= 0"),
    (["--moe_z_loss_coeff", "0"], "--moe_z_loss_coeff must be > 0"),
    (["--moe_expert_capacity_factor", "-1"], "--moe_expert_capacity_factor must be > 0"),
    (["--moe_pad_expert_input_to_capacity", "true"], "pass that too"),
    (["--moe_expert_capacity_factor", "1", "--moe_router_load_balancing_type", "sinkhorn"],
     "does not combine with --moe_router_load_balancing_type sinkhorn"),
    (["--router_replay_mode", "R3", "--moe_router_load_balancing_type", "sinkhorn"],
     "choose one"),
    (["--router_replay_mode", "R4"], "invalid choice 'R4'"),
    (["--router_replay_mode", "R3", "--multi_turn_scheduler", "calculator"],
     "drop --multi_turn_scheduler or use R2"),
])
def test_unworkable_values_are_refused(extra, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("'", "'")):
        flags(*extra)


def test_moe_flags_on_a_dense_model_are_refused():
    dense = dict(model_type="qwen3")
    args = flags("--moe_aux_loss_coeff", "0.01", "--router_replay_mode", "R2")
    with pytest.raises(UserError, match=r"^--moe_aux_loss_coeff, --router_replay_mode: MoE "
                                        r"flags, and this qwen3 model has no experts"):
        check_moe_flags(args.moe, args.explicit, dense, None)
    defaults = flags("--moe_router_dtype", "fp32")      # ms-swift scripts pass defaults
    check_moe_flags(defaults.moe, defaults.explicit, dense, None)
    overlap = flags("--moe_shared_expert_overlap", "true")
    with pytest.raises(UserError, match="this qwen3_moe model has no shared expert"):
        check_moe_flags(overlap.moe, overlap.explicit, dict(model_type="qwen3_moe"), 8)
    check_moe_flags(overlap.moe, overlap.explicit, dict(model_type="qwen3_5_moe_text",
                                                        shared_expert_intermediate_size=32), 8)


def test_router_replay_is_no_longer_an_unknown_flag():
    from swift_megatron.arguments.ms_swift import NOT_SUPPORTED

    assert "router_replay_mode" not in NOT_SUPPORTED
    assert flags("--router_replay_mode", "R3").moe.replays_routes


# ---- on the tiny qwen3_moe -------------------------------------------------------------------
MICRO_BATCHES, SEQ = 2, 12


@pytest.fixture
def cpu_state():
    from swift_megatron.parallel.state import ParallelState

    yield ParallelState.initialize(device="cpu", seed=0)
    ParallelState.destroy()


def _model(model_dir, state, *extra):
    """components.py's policy model (flags -> TransformerConfig -> weights), train mode."""
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.rlhf.grpo import components

    args = flags(*extra, model=model_dir)
    chunks, config, _ = components._load_model(args, state, model_dir, load_hf_config(model_dir),
                                               torch.float32, None)
    return chunks[0].train(), config


def _train_pass(model, config, state):
    """Two micro-batches forward and backward through megatron's schedule (a fixed loss of the
    logits); returns ({param name: grad}, [[router input per layer] per micro-batch], metrics)."""
    from swift_megatron.training.moe_losses import moe_loss_metrics
    from swift_megatron.training.step import forward_backward

    inputs = []
    for layer in model.decoder.layers:
        layer.mlp.router.register_forward_hook(
            lambda module, args, out: inputs.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    gen = torch.Generator().manual_seed(3)
    micro = [dict(tokens=torch.randint(0, 400, (1, SEQ), generator=gen),
                  position_ids=torch.arange(SEQ).unsqueeze(0)) for _ in range(MICRO_BATCHES)]
    forward_backward([model], micro, lambda mb, out: (out.logits().float().pow(2).mean(), {}))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    layers = len(model.decoder.layers)
    per_mb = [inputs[m * layers:(m + 1) * layers] for m in range(MICRO_BATCHES)]
    return grads, per_mb, moe_loss_metrics(config, MICRO_BATCHES, state.device)


def switch_loss(hidden, weight, top_k):
    """Switch Transformer / GShard load balancing of one router: E x sum_e f_e P_e, f_e the
    share of the token-expert assignments expert e got, P_e its mean router probability."""
    probs = torch.softmax(hidden @ weight.T, dim=-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0)
    tokens, experts = probs.shape
    return experts * (chosen.sum(0) / (tokens * top_k) * probs.mean(0)).sum()


def z_loss(hidden, weight):
    return torch.logsumexp(hidden @ weight.T, dim=-1).square().mean()


@pytest.mark.parametrize("kind,extra", [
    ("load_balancing_loss", ("--moe_aux_loss_coeff", "0.5")),
    ("z_loss", ("--moe_z_loss_coeff", "0.5"))])
def test_the_loss_reaches_the_gradient_and_the_metrics(tiny_model_dir, cpu_state, kind, extra):
    model_dir = tiny_model_dir("qwen3_moe")
    plain, _, plain_metrics = _train_pass(*_model(model_dir, cpu_state), cpu_state)
    model, config = _model(model_dir, cpu_state, *extra)
    grads, inputs, metrics = _train_pass(model, config, cpu_state)
    assert plain_metrics == {} and list(metrics) == [f"moe/{kind}"]
    loss = (lambda h, w: switch_loss(h, w, config.moe_router_topk)) \
        if kind == "load_balancing_loss" else z_loss
    last = f"decoder.layers.{config.num_layers - 1}.mlp.router.weight"
    weight = dict(model.named_parameters())[last].detach().requires_grad_()
    expected = sum(loss(mb[-1], weight) for mb in inputs) * 0.5 / MICRO_BATCHES
    expected_grad, = torch.autograd.grad(expected, weight)
    assert float(expected_grad.abs().max()) > 1e-4
    torch.testing.assert_close(grads[last] - plain[last], expected_grad, rtol=1e-4, atol=1e-7)
    per_layer = [float(loss(h, p)) for mb in inputs
                 for h, p in zip(mb, (l.mlp.router.weight for l in model.decoder.layers))]
    assert metrics[f"moe/{kind}"] == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-5)
    assert any(not torch.equal(grads[n], plain[n]) for n in grads if "router" not in n)


def test_router_dtype_reaches_the_routing(tiny_model_dir, cpu_state):
    model, config = _model(tiny_model_dir("qwen3_moe"), cpu_state, "--moe_router_dtype", "fp64")
    seen = []
    model.decoder.layers[0].mlp.router.register_forward_hook(
        lambda module, args, out: seen.append(out[0].dtype))
    _train_pass(model, config, cpu_state)
    assert config.moe_router_dtype == "fp64" and seen[0] == torch.float64


def test_shared_expert_overlap_computes_the_same(tiny_model_dir, cpu_state):
    model_dir = tiny_model_dir("qwen3_5_moe")
    plain, _, _ = _train_pass(*_model(model_dir, cpu_state), cpu_state)
    model, config = _model(model_dir, cpu_state, "--moe_shared_expert_overlap", "true")
    assert config.moe_shared_expert_overlap
    overlapped, _, _ = _train_pass(model, config, cpu_state)
    assert plain.keys() == overlapped.keys()
    for name in plain:
        torch.testing.assert_close(overlapped[name], plain[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("extra,logged", [
    (("--moe_router_load_balancing_type", "seq_aux_loss", "--moe_aux_loss_coeff", "0.01"),
     ["moe/seq_load_balancing_loss"]),
    (("--moe_router_load_balancing_type", "aux_loss", "global_aux_loss",
      "--moe_aux_loss_coeff", "0.01", "0.01"),
     ["moe/load_balancing_loss", "moe/global_load_balancing_loss"]),
    (("--moe_router_load_balancing_type", "sinkhorn"), []),
    (("--moe_expert_capacity_factor", "1.0", "--moe_token_drop_policy", "position"), []),
    (("--moe_expert_capacity_factor", "1.0", "--moe_pad_expert_input_to_capacity", "true"), [])])
def test_every_routing_setting_trains(tiny_model_dir, cpu_state, extra, logged):
    """Each setting runs a training pass with finite gradients that differ from the defaults'
    (sinkhorn routes by other scores, capacity drops tokens), and logs its losses."""
    model_dir = tiny_model_dir("qwen3_moe")
    plain, _, _ = _train_pass(*_model(model_dir, cpu_state), cpu_state)
    grads, _, metrics = _train_pass(*_model(model_dir, cpu_state, *extra), cpu_state)
    assert sorted(metrics) == sorted(logged) and all(0.5 < v < 8 for v in metrics.values())
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
    assert max(float((grads[n] - plain[n]).abs().max()) for n in plain) > 1e-7
