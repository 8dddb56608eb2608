"""ms-swift flags accepted by their names, and what each does here: --eval_iters (0 turns
evaluation off, -1 evaluates everything, other values are refused with the way to choose the
prompts), --moe_layer_recompute (recompute_modules moe), --train_dataloader_shuffle (the prompt
shuffle), the kernel-fusion and dataloader flags (accepted without effect, named by the dry run),
--ddp_timeout's default (ms-swift's) and --ddp_backend on a CPU."""
import pytest

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import no_effect_flags, parse_command
from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo.components import eval_steps


def rlhf(*argv):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *map(str, argv)],
                         "megatron rlhf")


def test_eval_iters():
    assert eval_steps(rlhf("--eval_steps", 10), has_validation=True) == 10
    assert eval_steps(rlhf("--eval_steps", 10, "--eval_iters", -1), has_validation=True) == 10
    assert eval_steps(rlhf("--eval_steps", 10, "--eval_iters", 0), has_validation=True) is None
    with pytest.raises(UserError, match=r"^--eval_iters 5: every evaluation covers all validation "
                                        r"prompts .* --val_dataset FILE#N"):
        rlhf("--eval_iters", 5)


def test_moe_layer_recompute_recomputes_the_moe_layer():
    assert rlhf("--moe_layer_recompute", "true").parallel.selective_recompute == \
        ["core_attn", "moe"]
    assert rlhf().parallel.selective_recompute == ["core_attn"]
    full = rlhf("--moe_layer_recompute", "true", "--recompute_granularity", "full")
    assert full.parallel.selective_recompute == []     # selective only, as --recompute_modules


def test_train_dataloader_shuffle_is_the_prompt_shuffle():
    assert rlhf("--train_dataloader_shuffle", "false").data.dataset_shuffle is False
    assert rlhf().data.dataset_shuffle is True


@pytest.mark.parametrize("flag, value", [
    ("masked_softmax_fusion", "true"), ("bias_dropout_fusion", "false"),
    ("bias_activation_fusion", "true"), ("apply_rope_fusion", "true"),
    ("cross_entropy_fusion_impl", "te"), ("attention_softmax_in_fp32", "true"),
    ("apply_query_key_layer_scaling", "true"), ("dataloader_pin_memory", "true"),
    ("dataloader_persistent_workers", "true"), ("dataloader_prefetch_factor", "4"),
    ("tensorboard_queue_size", "10"), ("save_missing_weights", "true"),
])
def test_flags_without_effect_are_accepted_and_named(flag, value):
    assert [name for name, _ in no_effect_flags(rlhf(f"--{flag}", value))] == [flag]


def test_ddp_defaults_and_backend():
    from swift_megatron.parallel.state import DEFAULT_TIMEOUT_S, _backend

    p = rlhf().parallel
    assert (p.ddp_timeout, p.ddp_backend) == (18000000, None) and DEFAULT_TIMEOUT_S == 18000000
    assert _backend(None, "gloo") == "gloo" and _backend("gloo", "nccl") == "gloo"
    with pytest.raises(UserError, match=r"^--ddp_backend nccl needs CUDA"):
        _backend("nccl", "gloo")
    with pytest.raises(UserError, match=r"^--ddp_timeout must be >= 1 second"):
        rlhf("--ddp_timeout", 0)


@pytest.mark.parametrize("argv, message", [
    (["--overlap_param_gather", "true", "--overlap_grad_reduce", "true",
      "--use_distributed_optimizer", "false"],
     r"^--overlap_param_gather needs --use_distributed_optimizer true"),
    (["--overlap_param_gather", "true"], r"^--overlap_param_gather needs --overlap_grad_reduce"),
    (["--overlap_grad_reduce", "true", "--freeze_vit", "false"],
     r"^--overlap_grad_reduce with a vision tower or aligner that trains is not supported"),
])
def test_overlap_rules(argv, message):
    with pytest.raises(UserError, match=message):
        rlhf(*argv)
