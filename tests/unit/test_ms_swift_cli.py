"""ms-swift's Megatron GRPO command lines run with us: every flag its public GRPO and export
examples use is accepted (or, for a feature another issue adds, refused with that reason), names
that drifted work both ways, bare booleans, config files as the first argument with their ENV
section, every unknown flag reported at once with a correct suggestion, ms-swift's defaults and
silent adjustments, its launch variables."""
import json
import os
import re
import subprocess
import sys

import pytest

from swift_megatron.arguments.commands import ExportCommandArguments, RlhfArguments
from swift_megatron.arguments.parser import notices, parse_command
from swift_megatron.errors import UserError
from swift_megatron.launch import planned_world_size, torchrun_argv


def rlhf(*argv):
    return parse_command(RlhfArguments, ["--model", "org/m", "--dataset", "d", *map(str, argv)],
                         "megatron rlhf")


# Every flag of ms-swift's public Megatron GRPO examples (examples/megatron/grpo/*.sh,
# examples/models/qwen3_5/mcore_grpo_moe.sh, examples/ascend/.../*grpo_megatron*.sh and the Ray
# YAML files), with a value one of them uses. Flags of features other issues add are below.
ACCEPTED = {
    "rlhf_type": "grpo", "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1, "expert_model_parallel_size": 1, "vllm_mode": "colocate",
    "use_vllm": "true", "tuner_type": "full", "save_safetensors": "true", "padding_free": "true",
    "num_generations": 8, "no_save_rng": None, "no_save_optim": None, "micro_batch_size": 4,
    "max_length": 8192, "max_completion_length": 2048, "lr": "1e-6", "logging_steps": 1,
    "global_batch_size": 128, "finetune": None, "dataset_num_proc": 8,
    "dataloader_num_workers": 8, "bf16": "true", "attention_backend": "flash",
    "temperature": "1.0", "steps_per_generation": 4, "recompute_granularity": "selective",
    "loss_type": "grpo", "log_completions": "true", "beta": "0.001",
    "vllm_max_model_len": 10240, "report_to": "tensorboard", "epsilon_high": "0.28",
    "epsilon": "0.2", "dynamic_sample": "false", "vllm_gpu_memory_utilization": "0.7",
    "sleep_level": 1, "reward_funcs": "accuracy", "overlong_filter": "true",
    "offload_optimizer": "true", "offload_model": "true", "num_train_epochs": 1,
    "save_steps": 1000, "offload_bridge": "false", "importance_sampling_level": "token",
    "merge_lora": "false", "vllm_tensor_parallel_size": 1, "system": "You are helpful.",
    "output_dir": "out", "eval_steps": 1000, "train_iters": 100, "sequence_parallel": "false",
    "enable_thinking": "false", "gradient_accumulation_fusion": "false", "top_p": "1.0",
    "top_k": 80, "target_modules": "all-linear", "optimizer_cpu_offload": "true",
    "use_precision_aware_optimizer": None, "lora_rank": 8, "lora_alpha": 32,
    "load_from_cache_file": "false", "split_dataset_ratio": 0, "recompute_method": None,
    "moe_permute_fusion": "true", "moe_expert_capacity_factor": 2, "check_model": "false",
    "log_rollout_offpolicy_metrics": "true", "cross_entropy_loss_fusion": "true",
    "lr_warmup_fraction": "0.0", "min_lr": "1e-7", "seed": 42,
    "vllm_server_host": "127.0.0.1", "vllm_server_port": 8000, "tau_pos": 1, "tau_neg": "1.05",
    "teacher_model": "Qwen/Qwen3.5-9B", "advantage_estimator": "rloo", "teacher_kl_coef": "1.0",
}
OTHER_ISSUES = {"teacher_model_server": "--teacher_model",
                "vllm_server_pass_dataset": "every dataset column reaches",
                "context_manager": "removed in ms-swift too", "vit_attn_impl": "Qwen3-VL",
                "packing": "--padding_free true",
                "use_ray": "torchrun, not Ray"}


# examples/megatron/grpo/multi_turn/frozen_lake.sh
MULTI_TURN = ["--multi_turn_scheduler", "gym_scheduler", "--gym_env", "frozen_lake",
              "--max_turns", 10, "--completion_length_limit_scope", "per_round"]


def test_multi_turn_flags_of_the_frozen_lake_example():
    args = rlhf(*MULTI_TURN, "--reward_funcs", "format", "--reward_weights", "0.2", "1.0")
    g = args.grpo
    assert (g.multi_turn_scheduler, g.gym_env, g.max_turns) == ("gym_scheduler", "frozen_lake", 10)
    assert g.use_gym_env is True and g.num_reward_columns == 2   # gym_env implies use_gym_env
    assert rlhf(*MULTI_TURN, "--use_gym_env", "false").grpo.use_gym_env is False
    plain = rlhf().grpo
    assert (plain.multi_turn_scheduler, plain.max_turns, plain.use_gym_env,
            plain.completion_length_limit_scope) == (None, None, False, "per_round")


@pytest.mark.parametrize("argv,message", [
    (["--max_turns", 3], "--max_turns applies to multi-turn rollouts: pass --multi_turn_scheduler"),
    (["--gym_env", "grid_world"], "--gym_env applies to multi-turn rollouts"),
    (["--completion_length_limit_scope", "total"], "--completion_length_limit_scope applies"),
    (MULTI_TURN[:2] + ["--max_turns", 0], "--max_turns must be >= 1"),
    (MULTI_TURN + ["--reward_funcs", "format", "--reward_weights", "1"],
     "--reward_weights has 1 values but --reward_funcs and --reward_model and --use_gym_env "
     "(gym_reward) name 2 rewards"),
])
def test_multi_turn_flag_errors_name_the_flags(argv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        rlhf(*argv)


@pytest.mark.parametrize("flag", sorted(ACCEPTED))
def test_every_example_flag_is_accepted(flag):
    value = ACCEPTED[flag]
    argv = [f"--{flag}"] + ([] if value is None else [str(value)])
    if flag == "recompute_method":
        argv = ["--recompute_granularity", "full", "--recompute_method", "uniform"]
    if flag == "optimizer_cpu_offload":  # as ms-swift's moe_colocate_full.sh passes it
        argv += ["--use_precision_aware_optimizer"]
    rlhf(*argv)


def test_flags_of_other_issues_are_refused_together_with_the_reason():
    argv = []
    for flag in OTHER_ISSUES:
        argv += [f"--{flag}", "1"]
    with pytest.raises(UserError) as error:
        rlhf(*argv)
    message = str(error.value)
    assert f"{len(OTHER_ISSUES)} unknown flags" in message
    for flag, reason in OTHER_ISSUES.items():
        line = next(line for line in message.splitlines() if line.strip().startswith(f"--{flag}:"))
        assert reason in line, line


def test_unknown_flags_are_all_reported_with_correct_suggestions():
    with pytest.raises(UserError) as error:
        rlhf("--micro_batch_sise", 2, "--learning_rate", "1e-6", "--per_device_train_batch_size",
             4, "--frobnicate", "x", "--gradient_accumulation_steps=8")
    lines = str(error.value).splitlines()
    assert "5 unknown flags" in lines[0]
    assert "--micro_batch_sise: did you mean --micro_batch_size?" in lines[1]
    assert "--learning_rate: use --lr" in lines[2]
    assert "--per_device_train_batch_size: use --micro_batch_size" in lines[3]
    assert "--frobnicate: no such flag" in lines[4]
    assert "--gradient_accumulation_steps: use --global_batch_size" in lines[5]


def test_values_and_flags_of_drifted_names():
    args = rlhf("--save_interval", 7, "--log_interval", 3, "--eval_interval", 9, "--tuner_type",
                "lora", "--bf16", "true")
    assert (args.training.save_steps, args.training.logging_steps, args.training.eval_steps) == \
        (7, 3, 9)
    assert args.training.train_type == "lora" and args.model.torch_dtype == "bfloat16"
    assert rlhf("--fp16", "true").model.torch_dtype == "float16"
    assert rlhf("--bf16", "false").model.torch_dtype is None
    with pytest.raises(UserError, match="--bf16 true contradicts --torch_dtype float32"):
        rlhf("--bf16", "true", "--torch_dtype", "float32")
    with pytest.raises(UserError, match="contradict each other"):
        rlhf("--bf16", "true", "--fp16", "true")


def test_ms_swift_defaults():
    t, g, p = (lambda a: (a.training, a.grpo, a.parallel))(rlhf())
    assert (t.save_steps, t.logging_steps, t.eval_steps, t.finetune, t.save_safetensors) == \
        (500, 5, None, True, True)
    assert t.merge_lora is True  # defaults to save_safetensors
    assert g.temperature == 0.9 and p.recompute_granularity == "selective"
    assert rlhf("--recompute_granularity", "none").parallel.recompute_granularity is None
    assert t.wandb_project == "megatron-swift" and t.add_version is True


def test_bare_booleans():
    args = rlhf("--finetune", "--no_save_optim", "--no_save_rng", "--use_precision_aware_optimizer",
                "--dataset_shuffle", "--lr", "1e-6")
    assert args.training.no_save_optim and args.training.no_save_rng
    assert args.training.use_precision_aware_optimizer and args.training.lr == 1e-6
    assert rlhf("--finetune", "false").training.finetune is False


def test_adapters_imply_lora_with_its_learning_rate():
    args = rlhf("--adapters", "a")
    assert args.training.train_type == "lora" and args.training.lr == 1e-4
    assert any("--train_type lora" in line for line in notices(args))


def test_silent_adjustments_and_ignored_flags_are_noticed():
    args = rlhf("--sequence_parallel", "true", "--gradient_accumulation_fusion", "true",
                "--moe_permute_fusion", "true")
    assert args.parallel.sequence_parallel is False
    lines = notices(args)
    assert any("--sequence_parallel true needs --tensor_model_parallel_size > 1" in line
               for line in lines)
    ignored = [line for line in lines if line.startswith("accepted without effect")]
    assert len(ignored) == 1 and "--gradient_accumulation_fusion" in ignored[0]
    assert "--moe_permute_fusion" in ignored[0] and "--padding_free" not in ignored[0]
    assert notices(rlhf()) == []
    # a real run names the adjustments but not the no-effect flags ms-swift's examples always
    # pass (issue 40): the dry run does
    quiet = notices(args, no_effect=False)
    assert quiet == [line for line in lines if not line.startswith("accepted without effect")]
    assert quiet


def test_recompute_modules_as_ms_swift():
    """ms-swift's default ["core_attn"], a list of its names, passed on with selective only;
    with another granularity the list is ignored (as megatron does under ms-swift), noticed."""
    assert rlhf().parallel.recompute_modules == ["core_attn"]
    p = rlhf("--recompute_modules", "core_attn", "moe", "layernorm").parallel
    assert p.selective_recompute == ["core_attn", "moe", "layernorm"]
    for granularity in ("full", "none"):
        args = rlhf("--recompute_granularity", granularity, "--recompute_modules", "mlp")
        assert args.parallel.selective_recompute == []
        assert any(f"--recompute_modules mlp takes effect with --recompute_granularity "
                   f"selective only: ignored with {granularity}" in line
                   for line in notices(args))
    assert notices(rlhf("--recompute_granularity", "full")) == []


@pytest.mark.parametrize("modules, message", [
    (["core_attn", "attention"], "--recompute_modules: invalid choice 'attention'; choose from "
                                 "core_attn, moe_act, layernorm, mla_up_proj, mlp, moe"),
    (["moe_act", "--moe_grouped_gemm", "false"], "--recompute_modules moe_act recomputes "
                                                 "grouped experts' activation, and "
                                                 "--moe_grouped_gemm false"),
    (["moe_act", "--train_type", "lora"], "--recompute_modules moe_act: LoRA on the experts' "
                                          "projections .* use --recompute_modules moe"),
    (["core_attn", "mla_up_proj"], "--recompute_modules mla_up_proj is not supported: .* MLA"),
])
def test_recompute_modules_refused_with_the_reason(modules, message):
    with pytest.raises(UserError, match=message):
        rlhf("--recompute_modules", *modules)


def test_recompute_modules_error_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--dry_run",
                           "true", "--recompute_modules", "mla_up_proj"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--recompute_modules mla_up_proj" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_algorithm_flags_of_the_examples_parse_together():
    """examples/megatron/grpo/sapo.sh, real.sh and opd_rl.sh: their algorithm flags together."""
    sapo = rlhf("--loss_type", "sapo", "--tau_pos", 1, "--tau_neg", "1.05", "--epsilon_high", "0.2")
    assert (sapo.grpo.loss_type, sapo.grpo.tau_pos, sapo.grpo.tau_neg) == ("sapo", 1.0, 1.05)
    real = rlhf("--loss_type", "real", "--micro_batch_size", 8, "--num_generations", 8,
                "--beta", "0.001")
    assert (real.grpo.scale_rewards, real.grpo.real_tau) == ("none", 0.5)  # ms-swift forces none
    opd = rlhf("--teacher_model", "Qwen/Qwen3.5-9B", "--num_generations", 1, "--beta", 0,
               "--loss_type", "grpo", "--log_rollout_offpolicy_metrics", "true")
    assert opd.grpo.has_teacher and opd.grpo.num_generations == 1 and opd.grpo.teacher_kl_coef == 1.0


def test_server_base_url():
    args = rlhf("--vllm_mode", "server", "--vllm_server_base_url", "http://10.0.0.2:8001",
                "10.0.0.3:8002")
    assert args.rollout.server_addresses() == ["10.0.0.2:8001", "10.0.0.3:8002"]
    with pytest.raises(UserError, match="expected http://host:port"):
        rlhf("--vllm_mode", "server", "--vllm_server_base_url", "http://h:port")


# ---- config files ----------------------------------------------------------------------------

def test_config_file_first_with_env_section(tmp_path, monkeypatch):
    monkeypatch.delenv("SWIFT_TEST_A", raising=False)
    monkeypatch.setenv("SWIFT_TEST_B", "shell")
    path = tmp_path / "run.yaml"
    path.write_text("ENV:\n  SWIFT_TEST_A: from_file\n  SWIFT_TEST_B: from_file\n"
                    "model: m\ndataset: [a.jsonl]\nmicro_batch_size: 2\nreward_funcs: [accuracy]\n"
                    "save_steps: 100\nfinetune: true\n")
    args = parse_command(RlhfArguments, [str(path), "--micro_batch_size", "4"], "megatron rlhf")
    assert args.batch.micro_batch_size == 4 and args.training.save_steps == 100
    assert os.environ["SWIFT_TEST_A"] == "from_file"
    assert os.environ["SWIFT_TEST_B"] == "shell"  # the shell wins, as in ms-swift
    assert {"micro_batch_size", "save_steps", "model"} <= args.explicit


def test_json_config_and_all_unknown_keys_at_once(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "m", "dataset": "d", "use_ray": True,
                                "colocate_groups": [["train", "rollout"]], "lerning_rate": 1}))
    with pytest.raises(UserError) as error:
        parse_command(RlhfArguments, [str(path)], "megatron rlhf")
    message = str(error.value)
    assert "3 unknown keys" in message and "torchrun, not Ray" in message
    assert "--lerning_rate: no such flag" in message


def test_config_file_that_is_missing_or_broken(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        parse_command(RlhfArguments, [str(tmp_path / "nope.yaml")], "megatron rlhf")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        parse_command(RlhfArguments, [str(bad)], "megatron rlhf")


def test_export_takes_a_config_file_too(tmp_path):
    path = tmp_path / "export.yaml"
    path.write_text("model: m\nto_mcore: true\noutput_dir: out\n")
    args = parse_command(ExportCommandArguments, [str(path)], "megatron export")
    assert args.export.to_mcore and args.export.output_dir == "out"


# ---- launching ---------------------------------------------------------------------------------

def test_nnodes_alone_relaunches_and_nproc_words_pass_through():
    cmd = torchrun_argv("rlhf", ["--x"], {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h"})
    assert cmd[3:6] == ["--nproc_per_node=1", "--nnodes=2", "--node_rank=1"]
    cmd = torchrun_argv("rlhf", [], {"NPROC_PER_NODE": "gpu"})
    assert cmd[3] == "--nproc_per_node=gpu"
    with pytest.raises(UserError, match="NPROC_PER_NODE=gpu but no GPU is visible"):
        planned_world_size({"NPROC_PER_NODE": "gpu"})
    assert planned_world_size({"NPROC_PER_NODE": "auto"}) == os.cpu_count()


def test_dry_run_checks_node_rank():
    proc = subprocess.run([sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--dry_run",
                           "true", "--reward_funcs", "accuracy", "--model", "Qwen/Qwen3-8B",
                           "--dataset", "AI-MO/NuminaMath-TIR"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NPROC_PER_NODE="1", NNODES="2", NODE_RANK="2"))
    assert proc.returncode == 2 and "NODE_RANK=2 must be smaller than NNODES=2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_flags_the_chosen_mode_ignores_are_noticed():
    from swift_megatron.preflight import preflight_rlhf

    args = rlhf("--lora_rank", 16, "--vllm_server_port", 9000, "--sleep_level", 1,
                "--global_batch_size", 8, "--device", "cpu")
    preflight_rlhf(args, world_size=1)
    lines = notices(args)
    assert "ignored here, they only act with --train_type lora: --lora_rank" in lines
    assert "ignored here, they only act with --vllm_mode server: --vllm_server_port" in lines
    assert "ignored here, they only act with the vLLM colocate engine: --sleep_level" in lines
    quiet = rlhf("--train_type", "lora", "--lora_rank", 16, "--global_batch_size", 8)
    preflight_rlhf(quiet, world_size=1)
    assert not any(line.startswith("ignored here") for line in notices(quiet))
    # issue 40: a server's key given to a colocate run was accepted without a word
    key = rlhf("--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_server_api_key", "k",
               "--global_batch_size", 8)
    preflight_rlhf(key, world_size=1)
    assert "ignored here, they only act with --vllm_mode server: --vllm_server_api_key" in \
        notices(key)


def test_colocate_flags_are_noticed_when_the_run_finds_no_cuda(monkeypatch, swift_logs):
    """issue 40: preflight assumes CUDA with --device auto; on a machine without it the run
    takes the embedded engine, and --offload_model was then ignored without a word."""
    import types

    import torch

    from swift_megatron.rlhf.grpo import components

    monkeypatch.setattr("swift_megatron.preflight.vllm_installed", lambda: True)
    monkeypatch.setattr("swift_megatron.rollout.factory.vllm_installed", lambda: True)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    auto = rlhf("--offload_model", "true", "--global_batch_size", 8)
    assert components.offloaders(auto, cpu, pol=None, reference=None) == []
    assert "ignored here, they only act with the vLLM colocate engine: --offload_model" in \
        swift_logs.text
    swift_logs.clear()   # --device cpu: preflight's notice already said it, once is enough
    components.offloaders(rlhf("--offload_model", "true", "--global_batch_size", 8, "--device",
                               "cpu"), cpu, pol=None, reference=None)
    assert "--offload_model" not in swift_logs.text


@pytest.mark.parametrize("argv, message", [
    (["--lr", "nan"], "expected a finite number"), (["--adam_beta1", "1.5"], r"in \[0, 1\)"),
    (["--weight_decay", "-5"], ">= 0"), (["--repetition_penalty", "-1"], "> 0"),
    (["--temperature", "inf"], "expected a finite number"), (["--min_lr", "1"], "must not exceed"),
    (["--lr_warmup_iters", "-3"], ">= 0"), (["--clip_grad", "-1"], ">= 0")])
def test_numeric_values_are_checked_up_front(argv, message):
    with pytest.raises(UserError, match=message):
        rlhf(*argv)


def test_eval_steps_without_validation_prompts_is_a_note(swift_logs):
    """ms-swift's frozen_lake.sh passes --eval_steps 1000 and no validation set: ms-swift then
    never evaluates, and so do we, saying so once (issue 40: it was an error)."""
    from swift_megatron.rlhf.grpo.components import eval_steps

    args = rlhf("--eval_steps", 1000, "--save_steps", 50)
    assert eval_steps(args, has_validation=False) is None
    assert any("--eval_steps 1000: no validation prompts" in r.getMessage()
               for r in swift_logs.records)
    assert eval_steps(args, has_validation=True) == 1000
    assert eval_steps(rlhf("--save_steps", 50), has_validation=True) == 50   # ms-swift's default
    assert eval_steps(rlhf("--save_steps", 50), has_validation=False) is None
