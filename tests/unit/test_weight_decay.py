"""Weight decay flags of ms-swift: --weight_decay_incr_style linear / cosine moves the decay from
--start_weight_decay to --end_weight_decay over the run (megatron's scheduler, against values
computed by hand), its flag rules, and --apply_wd_to_qk_layernorm decaying the query / key norms
that megatron otherwise exempts with every 1-D parameter (a real model's parameter groups)."""
import math
from types import SimpleNamespace

import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.training.optim import OptimizerSettings, build_scheduler


def decays(steps, **settings):
    """The weight decay after each of `steps` optimizer steps of a 10-step run."""
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = build_scheduler(optimizer, OptimizerSettings(lr=1e-3, train_iters=10, **settings))
    seen, done = [], 0
    for step in steps:
        scheduler.step(step - done)
        done = step
        seen.append(optimizer.param_groups[0]["weight_decay"])
    return seen


def test_constant_is_weight_decay():
    assert decays([0, 5, 10], weight_decay=0.05) == [0.05] * 3


def test_linear_and_cosine_go_from_start_to_end():
    ramp = dict(start_weight_decay=0.0, end_weight_decay=0.1)
    assert decays([0, 5, 10], weight_decay_incr_style="linear", **ramp) == \
        pytest.approx([0.0, 0.05, 0.1], abs=1e-15)
    # cosine: (cos(pi (1 - 2/10)) + 1) / 2 of the way at step 2
    assert decays([2, 10], weight_decay_incr_style="cosine", **ramp) == \
        pytest.approx([0.1 * (math.cos(math.pi * 0.8) + 1) / 2, 0.1], abs=1e-15)


def test_the_flags_reach_the_schedule():
    from swift_megatron.rlhf.grpo.components import optimizer_settings

    args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d",
                                         "--weight_decay_incr_style", "linear",
                                         "--start_weight_decay", "0.01",
                                         "--end_weight_decay", "0.2",
                                         "--apply_wd_to_qk_layernorm", "true"], "x")
    settings = optimizer_settings(args, 10)
    assert (settings.weight_decay_incr_style, settings.start_weight_decay,
            settings.end_weight_decay, settings.apply_wd_to_qk_layernorm) == \
        ("linear", 0.01, 0.2, True)


@pytest.mark.parametrize("argv, message", [
    (["--start_weight_decay", "0.1"], r"^--start_weight_decay needs --weight_decay_incr_style "
                                      r"linear or cosine"),
    (["--weight_decay_incr_style", "cosine", "--end_weight_decay", "0.1"],
     r"^--weight_decay_incr_style cosine needs --start_weight_decay and --end_weight_decay"),
])
def test_rules(argv, message):
    with pytest.raises(UserError, match=message):
        parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *argv], "x")


def _norm_decays(tiny_model_dir, apply: bool):
    """{parameter name: weight decay of its group} of megatron's optimizer on tiny qwen3 (the
    scheduler's: --weight_decay x the group's wd_mult)."""
    from swift_megatron.model.build import build_model
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.training.optim import build_optimizer, torch_optimizers, wrap_ddp

    model, config, _ = build_model(load_hf_config(tiny_model_dir("qwen3")), torch.float32,
                                   torch.device("cpu"))
    ddp = wrap_ddp(model, config, False)
    settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, apply_wd_to_qk_layernorm=apply)
    optimizer = build_optimizer([ddp], config, settings)
    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                name = names.get(id(param)) or names.get(id(getattr(param, "model_param", None)))
                found[name] = settings.weight_decay * group["wd_mult"]
    return found


def test_apply_wd_to_qk_layernorm(single_process_group, tiny_model_dir):
    from megatron.core import parallel_state

    from swift_megatron.parallel.state import ParallelState

    ParallelState.initialize(device="cpu", seed=0)
    try:
        plain, applied = (_norm_decays(tiny_model_dir, apply) for apply in (False, True))
    finally:
        parallel_state.destroy_model_parallel()
    qk = [n for n in plain if "q_layernorm" in n or "k_layernorm" in n]
    assert qk and all(plain[n] == 0.0 and applied[n] == 0.1 for n in qk)
    other_norms = [n for n in plain if "layernorm" in n and n not in qk]
    assert other_norms and all(applied[n] == plain[n] == 0.0 for n in other_norms)
