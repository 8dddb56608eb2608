"""training/optim.py without a model: the learning rate of every --lr_decay_style at chosen
steps against values computed by hand, the schedule's UserErrors, the optimizer flags reaching
megatron's OptimizerConfig, and the configurations megatron-core 0.16.1 cannot run (UserErrors
naming the flags). A real optimizer step with these settings: tests/unit/test_wiring_models.py."""
import math
from types import SimpleNamespace

import pytest
import torch

from swift_megatron.errors import UserError
from swift_megatron.training.optim import (OptimizerSettings, build_scheduler, check_settings,
                                           optimizer_config, schedule_steps)

LR, MIN_LR = 1e-3, 1e-4
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def lrs(steps, **settings):
    """The learning rate after each of `steps` optimizer steps (the trainer's scheduler.step(1)
    per step)."""
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = build_scheduler(optimizer, OptimizerSettings(lr=LR, min_lr=MIN_LR, **settings))
    seen, done = {}, 0
    for step in sorted(steps):
        scheduler.step(step - done)
        done = step
        seen[step] = optimizer.param_groups[0]["lr"]
    return [seen[step] for step in steps]


def approx(values):
    return pytest.approx(values, rel=1e-12, abs=0)


# ---- learning rates ---------------------------------------------------------------------------

def test_linear_with_warmup_from_lr_warmup_init():
    # warmup 2 steps from 1e-4 to 1e-3, then linear to 1e-4 at step 10 (= train_iters)
    got = lrs([0, 1, 2, 6, 10, 11], lr_decay_style="linear", lr_warmup_iters=2,
              lr_warmup_init=1e-4, train_iters=10)
    # step 1: 1e-4 + 9e-4 * 1/2; step 6: decay ratio (6-2)/(10-2) = 0.5 -> 1e-4 + 0.5 * 9e-4
    assert got == approx([1e-4, 5.5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4])


def test_cosine_decays_over_lr_decay_iters_not_train_iters():
    got = lrs([0, 2, 4, 8, 9], lr_decay_style="cosine", lr_decay_iters=8, train_iters=10)
    # step 2: ratio 1/4, coefficient (cos(pi/4) + 1) / 2 = (2 + sqrt 2) / 4
    step2 = 1e-4 + 9e-4 * (2 + math.sqrt(2)) / 4          # 8.68198051533946e-4
    assert got == approx([1e-3, step2, 5.5e-4, 1e-4, 1e-4])
    assert step2 == pytest.approx(8.68198051533946e-4, rel=1e-14)


def test_lr_decay_iters_defaults_to_train_iters():
    assert lrs([2, 4], lr_decay_style="cosine", train_iters=4) == approx([5.5e-4, 1e-4])


def test_constant_warms_up_then_holds_lr():
    got = lrs([0, 1, 4, 9], lr_decay_style="constant", lr_warmup_iters=4, train_iters=10)
    assert got == approx([0.0, 2.5e-4, 1e-3, 1e-3])


def test_inverse_square_root():
    # lr * sqrt(warmup) / sqrt(step) after a 4-step warmup, min_lr past --lr_decay_iters
    got = lrs([2, 4, 16, 64, 100, 101], lr_decay_style="inverse-square-root",
              lr_warmup_iters=4, train_iters=100)
    assert got == approx([5e-4, 1e-3, 5e-4, 2.5e-4, 2e-4, 1e-4])


def test_inverse_square_root_never_below_min_lr():
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = build_scheduler(optimizer, OptimizerSettings(
        lr=LR, min_lr=3e-4, lr_decay_style="inverse-square-root", lr_warmup_iters=4,
        train_iters=100))
    scheduler.step(64)                                     # 1e-3 * 2 / 8 = 2.5e-4 < 3e-4
    assert optimizer.param_groups[0]["lr"] == 3e-4


@pytest.mark.parametrize("style, at_17, at_18", [
    ("linear", 1e-4 + 9e-4 * 0.75, 5.5e-4),
    ("cosine", 1e-4 + 9e-4 * (2 + math.sqrt(2)) / 4, 5.5e-4),
    ("exponential", 1e-4 + 9e-4 * (2 * 0.5 ** 0.25 - 1), 1e-4 + 9e-4 * (math.sqrt(2) - 1)),
    ("minus_sqrt", 5.5e-4, 1e-4 + 9e-4 * (1 - math.sqrt(0.5))),
])
def test_wsd_holds_lr_then_decays_over_the_last_lr_wsd_decay_iters(style, at_17, at_18):
    # 20 steps, warmup 2, the last 4 decay: lr until step 16, then ratio (step - 16) / 4
    got = lrs([1, 10, 16, 17, 18, 20], lr_decay_style="WSD", lr_warmup_iters=2, train_iters=20,
              lr_wsd_decay_iters=4, lr_wsd_decay_style=style)
    assert got == approx([5e-4, 1e-3, 1e-3, at_17, at_18, 1e-4])


def test_warmup_fraction_of_lr_decay_iters_wins_over_warmup_iters():
    # 0.25 x 10 = 2.5 warmup steps (fractional, as Megatron-LM and ms-swift)
    got = lrs([1, 2, 3], lr_decay_style="linear", lr_warmup_fraction=0.25, lr_warmup_iters=5,
              lr_decay_iters=10, train_iters=20)
    # step 3: decay ratio 0.5 / 7.5 -> 1e-4 + 9e-4 * 14/15
    assert got == approx([4e-4, 8e-4, 9.4e-4])


def test_schedule_steps():
    steps = schedule_steps(OptimizerSettings(lr=LR, lr_decay_style="WSD", lr_warmup_fraction=0.1,
                                             lr_decay_iters=50, lr_wsd_decay_iters=10,
                                             train_iters=60))
    assert (steps.warmup, steps.decay, steps.wsd_decay) == (5.0, 50, 10)
    assert schedule_steps(OptimizerSettings(lr=LR, train_iters=7, lr_wsd_decay_iters=3)).wsd_decay \
        is None  # only WSD uses it


@pytest.mark.parametrize("settings, message", [
    (dict(lr_warmup_iters=10, train_iters=10),
     r"^--lr_warmup_iters: the warmup \(10 steps\) must end before the decay does "
     r"\(--train_iters 10\)"),
    (dict(lr_warmup_iters=6, lr_decay_iters=5, train_iters=10),
     r"^--lr_warmup_iters: .*\(--lr_decay_iters 5\)"),
    (dict(lr_decay_style="WSD", lr_warmup_iters=2, lr_wsd_decay_iters=9, train_iters=10),
     r"^--lr_wsd_decay_iters 9 is longer than the steps between the warmup and the end of the "
     r"decay \(--train_iters 10 - warmup 2\)$"),
    (dict(min_lr=2e-3), r"^--min_lr 0.002 must not exceed --lr 0.001$"),
    (dict(lr_warmup_init=2e-3), r"^--lr_warmup_init 0.002 must not exceed --lr 0.001$"),
])
def test_schedules_that_do_not_fit_are_user_errors(settings, message):
    full = OptimizerSettings(**{"lr": LR, "train_iters": 10, **settings})
    with pytest.raises(UserError, match=message):
        check_settings(full, CPU, torch.float32)
    with pytest.raises(UserError, match=message):
        build_scheduler(SimpleNamespace(param_groups=[{}]), full)


# ---- optimizer settings -----------------------------------------------------------------------

def model_config(dtype=torch.bfloat16):
    return SimpleNamespace(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                           params_dtype=dtype)


def test_flags_reach_megatrons_optimizer_config():
    settings = OptimizerSettings(lr=2e-5, min_lr=1e-6, weight_decay=0.05, adam_beta1=0.8,
                                 adam_beta2=0.9, adam_eps=1e-6, clip_grad=0.5,
                                 use_distributed_optimizer=True, optimizer_cpu_offload=True,
                                 optimizer_offload_fraction=0.7,
                                 use_precision_aware_optimizer=True)
    config = optimizer_config(settings, model_config())
    got = {name: getattr(config, name) for name in (
        "optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
        "clip_grad", "bf16", "fp16", "params_dtype", "use_distributed_optimizer",
        "optimizer_cpu_offload", "optimizer_offload_fraction", "use_precision_aware_optimizer")}
    assert got == dict(optimizer="adam", lr=2e-5, min_lr=1e-6, weight_decay=0.05, adam_beta1=0.8,
                       adam_beta2=0.9, adam_eps=1e-6, clip_grad=0.5, bf16=True, fp16=False,
                       params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                       optimizer_cpu_offload=True, optimizer_offload_fraction=0.7,
                       use_precision_aware_optimizer=True)
    # the precision-aware path with the hybrid optimizer: gradients go to `decoupled_grad`
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 is True


def test_defaults_keep_the_plain_optimizer():
    config = optimizer_config(OptimizerSettings(lr=1e-5), model_config(torch.float32))
    assert (config.adam_eps, config.optimizer_cpu_offload, config.use_precision_aware_optimizer,
            config.use_distributed_optimizer) == (1e-8, False, False, False)


DIST = dict(use_distributed_optimizer=True)
OFFLOAD = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, **DIST)


@pytest.mark.parametrize("settings, device, dtype, message", [
    (OFFLOAD, CPU, torch.float32, r"^--optimizer_cpu_offload needs CUDA"),
    (OFFLOAD, CUDA, torch.float32,
     r"^--optimizer_cpu_offload needs bf16 or fp16 training \(--torch_dtype bfloat16\)"),
])
def test_what_megatron_core_cannot_run_is_a_user_error(settings, device, dtype, message):
    with pytest.raises(UserError, match=message):
        check_settings(OptimizerSettings(lr=LR, **settings), device, dtype)


@pytest.mark.parametrize("argv, message", [
    (["--optimizer_cpu_offload", "true"],
     r"^--optimizer_cpu_offload needs --use_precision_aware_optimizer true, as Megatron-LM "
     r"requires"),
    (["--use_precision_aware_optimizer", "true", "--use_distributed_optimizer", "false"],
     r"^--optimizer_cpu_offload and --use_precision_aware_optimizer need "
     r"--use_distributed_optimizer true$"),
])
def test_optimizer_flag_combinations_fail_at_parse_time(argv, message):
    """Before anything starts (the dry run too): these need no model or device to judge."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command

    with pytest.raises(UserError, match=message):
        parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *argv], "megatron rlhf")


def test_precision_aware_alone_keeps_megatrons_plain_optimizer():
    """Without the hybrid optimizer megatron-core 0.16.1 would need Transformer Engine's
    FusedAdam: megatron builds its usual optimizer and training/adam_states.py keeps the
    moments (tests/unit/test_adam_states.py)."""
    settings = OptimizerSettings(lr=LR, use_precision_aware_optimizer=True, **DIST)
    check_settings(settings, CUDA, torch.bfloat16)
    assert optimizer_config(settings, model_config()).use_precision_aware_optimizer is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offload_configurations_that_run_on_cuda_pass(dtype, fraction):
    check_settings(OptimizerSettings(lr=LR, optimizer_offload_fraction=fraction, **OFFLOAD),
                   CUDA, dtype)


@pytest.mark.parametrize("extra, saved_optimizer, fails", [
    ([], True, True), (["--no_load_optim", "true"], True, False), ([], False, False)])
def test_resuming_the_offloaded_optimizer_state_is_a_user_error(tmp_path, extra, saved_optimizer,
                                                                fails):
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.checkpoint.start import Start
    from swift_megatron.rlhf.grpo.components import _check_offload_resume

    if saved_optimizer:
        (tmp_path / "optimizer").mkdir()
    args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d",
                                         "--optimizer_cpu_offload", "true",
                                         "--use_precision_aware_optimizer", "true", *extra], "x")
    start = Start(weights=None, adapter=None, resume_dir=str(tmp_path))
    if not fails:
        _check_offload_resume(args, start)
        return
    with pytest.raises(UserError, match=r"^--optimizer_cpu_offload: resuming the optimizer state "
                                        r".* pass --no_load_optim"):
        _check_offload_resume(args, start)


def _adamw_wrapped(foreach=True):
    """Two parameters under torch's AdamW, inside megatron's chained-optimizer shape."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
              torch.nn.Parameter(torch.randn(7, generator=gen))]
    adam = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
    return params, adam, SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])


def _steps(params, adam, count, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        adam.step()


def test_use_fused_adam_switches_the_kernel_and_keeps_the_update():
    from swift_megatron.platform import cuda_paths
    from swift_megatron.training.optim import adam_step_tensor, use_fused_adam

    params, adam, wrapped = _adamw_wrapped()
    ref_params, ref_adam, _ = _adamw_wrapped()
    _steps(params, adam, 2)
    _steps(ref_params, ref_adam, 2)
    use_fused_adam(wrapped)            # parameters on the CPU: a CUDA switch leaves them be
    assert adam.param_groups[0]["fused"] is None and adam.param_groups[0]["foreach"]

    with cuda_paths.on_cpu():   # the CPU takes CUDA's path: torch's fused CPU kernel
        use_fused_adam(wrapped)   # midway, as after loading a checkpoint
    assert adam.param_groups[0]["fused"] is True and adam.param_groups[0]["foreach"] is False
    assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 2
               for s in adam.state.values())
    _steps(params, adam, 3, seed=2)
    _steps(ref_params, ref_adam, 3, seed=2)
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert float(next(iter(adam.state.values()))["step"]) == 5
    assert adam_step_tensor(3.0, params[0], fused=False).device.type == "cpu"


def test_use_fused_adam_leaves_other_optimizers_alone():
    from swift_megatron.platform import cuda_paths
    from swift_megatron.training.optim import use_fused_adam

    param = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([param], lr=0.1)
    with cuda_paths.on_cpu():
        use_fused_adam(SimpleNamespace(optimizer=sgd))
    assert sgd.param_groups[0].get("fused") is None
