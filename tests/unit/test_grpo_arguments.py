"""The GRPO algorithm flags of issue 14: ms-swift's defaults and how they resolve, and every
contradiction refused up front with a UserError naming the flags."""
import pytest

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError


def grpo(*argv):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *map(str, argv)],
                         "megatron rlhf").grpo


def test_ms_swift_defaults():
    g = grpo()
    assert (g.loss_type, g.tau_pos, g.tau_neg, g.real_tau) == ("grpo", 1.0, 1.05, 0.5)
    assert (g.fipo_decay_rate, g.fipo_clip_range, g.fipo_clip_high_only,
            g.fipo_safety_threshold) == (32.0, 0.2, True, 4.0)
    assert (g.advantage_estimator, g.scale_rewards, g.kl_in_reward) == ("grpo", "group", False)
    assert (g.top_entropy_quantile, g.log_entropy, g.num_iterations) == (1.0, False, 1)
    assert (g.sync_ref_model, g.ref_model_sync_steps, g.ref_model_mixup_alpha) == (False, 512, 0.6)
    assert (g.teacher_kl_coef, g.off_policy_sequence_mask_delta) == (1.0, None)


@pytest.mark.parametrize("estimator,scale,kl", [("grpo", "group", False), ("rloo", "none", True),
                                                ("reinforce_plus_plus", "batch", True)])
def test_scale_rewards_and_kl_in_reward_follow_the_estimator(estimator, scale, kl):
    g = grpo("--advantage_estimator", estimator)
    assert (g.scale_rewards, g.kl_in_reward) == (scale, kl)
    explicit = grpo("--advantage_estimator", estimator, "--scale_rewards", "group",
                    "--kl_in_reward", "false")
    assert (explicit.scale_rewards, explicit.kl_in_reward) == ("group", False)


def test_real_defaults_to_unscaled_rewards():
    assert grpo("--loss_type", "real").scale_rewards == "none"
    with pytest.raises(UserError, match="--loss_type real .* --scale_rewards must be none"):
        grpo("--loss_type", "real", "--scale_rewards", "group")
    for flag, value in (("--top_entropy_quantile", 0.5),
                        ("--rollout_importance_sampling_mode", "token_mask")):
        with pytest.raises(UserError, match=f"{flag} has no effect with --loss_type real"):
            grpo("--loss_type", "real", flag, value)


def test_gdpo_contradictions():
    assert grpo("--scale_rewards", "gdpo").kl_in_reward is False
    with pytest.raises(UserError, match="--scale_rewards gdpo .* cannot take --kl_in_reward"):
        grpo("--scale_rewards", "gdpo", "--kl_in_reward", "true")
    with pytest.raises(UserError, match="needs --advantage_estimator grpo, got rloo"):
        grpo("--scale_rewards", "gdpo", "--advantage_estimator", "rloo")


def test_cispo_needs_an_absolute_epsilon_high():
    with pytest.raises(UserError, match="--loss_type cispo caps .* --epsilon_high, which is 0.2"):
        grpo("--loss_type", "cispo")
    assert grpo("--loss_type", "cispo", "--epsilon_high", 5).epsilon_high == 5.0


@pytest.mark.parametrize("argv,message", [
    (["--tau_pos", 0], "--tau_pos must be > 0"),
    (["--real_tau", -1], "--real_tau must be > 0"),
    (["--fipo_decay_rate", 0], "--fipo_decay_rate must be > 0"),
    (["--fipo_clip_range", -0.1], "--fipo_clip_range must be >= 0"),
    (["--top_entropy_quantile", 0], r"--top_entropy_quantile must be in \(0, 1\]"),
    (["--num_iterations", 0], "--num_iterations must be >= 1"),
    (["--ref_model_mixup_alpha", 1.5], r"--ref_model_mixup_alpha must be in \[0, 1\]"),
    (["--sync_ref_model", "true", "--ref_model_sync_steps", 0], "--ref_model_sync_steps must be >= 1"),
    (["--sync_ref_model", "true", "--beta", 0], "--sync_ref_model true needs a reference"),
    (["--ref_model", "a", "--mcore_ref_model", "b"], "pass --ref_model or --mcore_ref_model"),
    (["--ref_adapters", "a", "b"], "--ref_adapters takes one adapter"),
    (["--num_generations", 1], "1 only with --teacher_model"),
    (["--offload_teacher_model", "true"], "--offload_teacher_model needs --teacher_model"),
    (["--reward_model", "rm", "--reward_model_plugin", "a", "b"], "names 2 plugins for 1"),
    (["--reward_funcs", "accuracy", "--reward_model", "rm", "--reward_weights", 1],
     "--reward_weights has 1 values but --reward_funcs and --reward_model name 2 rewards"),
])
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(UserError, match=message):
        grpo(*argv)


@pytest.mark.parametrize("argv,message", [
    (["--loss_type", "real"], "--loss_type real needs one advantage per completion"),
    (["--loss_type", "fipo"], "--loss_type fipo needs one advantage per completion"),
    (["--off_policy_sequence_mask_delta", 0.1], "--off_policy_sequence_mask_delta needs one"),
    (["--dynamic_sample", "true", "--num_generations", 1, "--reward_funcs", "accuracy"],
     "--dynamic_sample .* needs --reward_funcs and --num_generations >= 2"),
    (["--scale_rewards", "gdpo"], "--scale_rewards gdpo normalises reward functions"),
])
def test_teacher_contradictions(argv, message):
    with pytest.raises(UserError, match=message):
        grpo("--teacher_model", "t", *argv)


def test_teacher_allows_one_generation_and_no_rewards():
    g = grpo("--teacher_model", "t", "--num_generations", 1, "--teacher_kl_coef", 0.5)
    assert g.has_teacher and g.num_generations == 1 and g.teacher_kl_coef == 0.5


def test_teacher_server_is_refused_with_the_alternative():
    with pytest.raises(UserError, match="--teacher_model_server: .* --teacher_model"):
        grpo("--teacher_model_server", "http://localhost:8000")


def test_real_checks_whole_groups_before_building_anything():
    from swift_megatron.arguments.batch_plan import BatchPlanError, make_batch_plan
    from swift_megatron.arguments.commands import batch_inputs
    from swift_megatron.preflight import check_group_loss

    def check(*argv):
        args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--loss_type",
                                             "real", *map(str, argv)], "megatron rlhf")
        check_group_loss(args, make_batch_plan(batch_inputs(args, world_size=1)))

    check("--num_generations", 4, "--micro_batch_size", 4, "--global_batch_size", 16)
    with pytest.raises(BatchPlanError, match="--loss_type real .* micro_batch_size=2 must be a "
                                             "multiple of num_generations=4"):
        check("--num_generations", 4, "--micro_batch_size", 2, "--global_batch_size", 16)
    with pytest.raises(UserError, match="--max_tokens_per_micro_batch cuts micro-batches"):
        check("--num_generations", 4, "--micro_batch_size", 4, "--global_batch_size", 16,
              "--max_tokens_per_micro_batch", 512)
