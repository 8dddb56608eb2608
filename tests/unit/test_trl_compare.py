"""benchmarks/trl_compare.py's TRL launch: torchrun accepts the worker's command line at 2 GPUs
(an option of the worker's named like one of torchrun's own made torchrun refuse it as
ambiguous on the two-GPU machine) and passes the worker's options through unchanged; the
order of the runs (`--trl_first`) with the ratio lines it ends with; and which rollout batches
the averages hold (`--warmup_batches`); the train phase's model FLOPs (full and LoRA)."""
import argparse
import json
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
trl_compare = pytest.importorskip("trl_compare")
TASK = ["--dataset", "/d.jsonl", "--reward_funcs", "accuracy"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_trl_worker_line_parses_under_torchrun(nproc):
    from torch.distributed.run import get_args_parser

    a = argparse.Namespace(nproc=nproc, work_dir="/w", rollout_batches=4, completion_length=256,
                           sleep_level=2, trl_fastest='{"use_liger_kernel": true}')
    cmd = trl_compare.trl_command(a, "/m", TASK, "fastest")
    worker = cmd[cmd.index(os.path.abspath(trl_compare.__file__)):]
    if nproc == 1:
        assert cmd[1:] == worker
        return
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    parsed = get_args_parser().parse_args(cmd[3:])
    assert parsed.nproc_per_node == "2"
    assert [parsed.training_script, *parsed.training_script_args] == worker
    assert "--trl_worker" in worker and "--nproc" not in worker
    assert worker[worker.index("--sleep_level") + 1] == "2"   # both tools at one level
    assert json.loads(worker[worker.index("--task") + 1]) == TASK
    assert worker[worker.index("--trl_setting") + 1] == "fastest"
    assert json.loads(worker[worker.index("--trl_config") + 1]) == {
        "gradient_checkpointing": False, "use_liger_kernel": True}


def test_trl_settings_defaults_and_fastest():
    a = argparse.Namespace(trl_fastest="{}")
    assert trl_compare.trl_overrides(a, "defaults") == {}
    assert trl_compare.trl_overrides(a, "fastest") == {"gradient_checkpointing": False}


@pytest.mark.parametrize("trl_first, order", [
    (False, ["ours", "wide", "trl_defaults", "trl_fastest"]),
    (True, ["trl_defaults", "trl_fastest", "ours", "wide"])])
def test_trl_first_swaps_the_order_and_keeps_the_ratios(monkeypatch, capsys, tmp_path,
                                                        trl_first, order):
    ran = []

    def ours(a, model, task, label, extra):
        ran.append(label)
        return {"wall_s": 2.0 if label == "ours" else 4.0, "peak_gib": 30.0,
                "device_peak_gib": 45.0}

    def trl(a, model, task, setting):
        ran.append(f"trl_{setting}")
        return {"wall_s": 8.0 if setting == "defaults" else 5.0, "peak_gib": 40.0,
                "device_peak_gib": 60.0 if setting == "defaults" else 50.0}

    monkeypatch.setattr(trl_compare, "prepare", lambda a: ("/m", TASK))
    monkeypatch.setattr(trl_compare, "run_ours", ours)
    monkeypatch.setattr(trl_compare, "run_trl", trl)
    monkeypatch.setattr(sys, "argv", ["trl_compare.py", "--work_dir", str(tmp_path),
                                      "--variant", "wide=--x 1",
                                      *(["--trl_first"] if trl_first else [])])
    trl_compare.main()
    assert ran == order
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ratios = [(r["tool"], r["baseline"], r["speedup_vs_trl"], r["memory_vs_trl"],
               r["device_memory_vs_trl"]) for r in lines if r["name"] == "ratio"]
    assert ratios == [("ours", "trl_defaults", 4.0, 0.75, 0.75),
                      ("ours", "trl_fastest", 2.5, 0.75, 0.9),
                      ("wide", "trl_defaults", 2.0, 0.75, 0.75),
                      ("wide", "trl_fastest", 1.25, 0.75, 0.9)]
    headline, = [r for r in lines if r["name"] == "headline"]
    assert (headline["baseline"], headline["speedup_vs_trl"]) == ("trl_fastest", 2.5)


@pytest.mark.parametrize("warmup, mean", [(1, 7.0), (2, 5.5), (3, 6.0)])
def test_warmup_batches_leave_the_first_batches_out(monkeypatch, capsys, tmp_path, warmup, mean):
    """Rollout batches ending at 10, 20, 25, 31 s: walls 10, 5, 6 s for batches 2-4."""
    def fake_trl(cmd, check):
        with open(tmp_path / "trl_steps_defaults.jsonl", "w") as f:
            for step, end in zip(range(1, 9), [5, 10, 15, 20, 22, 25, 28, 31]):
                f.write(json.dumps(dict(step=step, time=end, peak_gib=float(step),
                                        completion_length_mean=9.0)) + "\n")

    monkeypatch.setattr(trl_compare.subprocess, "run", fake_trl)
    monkeypatch.setattr(trl_compare, "device_used_gib", lambda: None)   # no GPU here
    a = argparse.Namespace(nproc=1, work_dir=str(tmp_path), rollout_batches=4,
                           completion_length=256, sleep_level=1, warmup_batches=warmup,
                           trl_fastest="{}")
    result = trl_compare.run_trl(a, "/m", TASK)
    assert result == {"wall_s": mean, "peak_gib": 8.0, "torch_peak_gib": 8.0,
                      "device_peak_gib": None, "config": {}}
    batches = [json.loads(line)["batch"] for line in capsys.readouterr().out.splitlines()]
    assert batches == [2, 3, 4]   # every batch is still printed


@pytest.mark.parametrize("warmup", ["0", "4"])
def test_warmup_batches_must_leave_a_batch(monkeypatch, capsys, warmup):
    monkeypatch.setattr(sys, "argv", ["trl_compare.py", "--rollout_batches", "4",
                                      "--warmup_batches", warmup])
    with pytest.raises(SystemExit) as exc:
        trl_compare.main()
    assert exc.value.code == 2
    assert "--warmup_batches" in capsys.readouterr().err


def test_device_peak_is_the_largest_sample_over_the_start(monkeypatch):
    """NVML samples 10 (at the start), 30, 52, 41 GiB: the block's peak is 42 GiB."""
    samples = iter([10.0, 30.0, 52.0, 41.0])
    monkeypatch.setattr(trl_compare, "device_used_gib", lambda: next(samples, 41.0))
    with trl_compare.DevicePeak(interval_s=0.01) as device:
        import time
        time.sleep(0.2)
    assert device.peak_gib == 42.0


def test_lora_gives_both_tools_the_same_adapter():
    """--lora 16: ours with ms-swift's LoRA flags, TRL's worker with the rank to build peft's."""
    a = argparse.Namespace(nproc=1, work_dir="/w", rollout_batches=4, completion_length=256,
                           sleep_level=1, lora=16, trl_fastest="{}", rlhf_args=["--seed", "1"])
    ours = trl_compare.ours_command(a, "/m", TASK, "/o", [])
    assert ours[-10:] == ["--train_type", "lora", "--lora_rank", "16", "--lora_alpha", "32",
                          "--lora_dropout", "0.05", "--seed", "1"]
    worker = trl_compare.trl_command(a, "/m", TASK, "defaults")
    assert worker[worker.index("--lora") + 1] == "16"
    assert trl_compare.peft_config(0) is None


def test_ours_trains_on_the_task_flags():
    a = argparse.Namespace(nproc=1, completion_length=256, rollout_batches=4, sleep_level=1,
                           lora=0, rlhf_args=[])
    task = ["--dataset", "/c.jsonl", "--external_plugins", "/r.py", "--reward_funcs",
            "colour_parity"]
    cmd = trl_compare.ours_command(a, "/m", task, "/o", [])
    assert cmd[cmd.index("--model") + 2:][:6] == task
    assert cmd.count("--reward_funcs") == 1 and trl_compare.task_value(task, "--lora") is None


def test_trl_gets_the_image_task_as_ours(tmp_path):
    """The colour task for TRL: conversational prompts, the images decoded, and the reward
    given TRL's chat-message completions scores as ours scores the texts (colour_parity: the
    first token id's parity against red/blue)."""
    from grpo_step import build_task

    task = build_task("tiny-vl", str(tmp_path))
    data = trl_compare.trl_dataset(task)
    rows = [json.loads(line) for line in open(trl_compare.task_value(task, "--dataset"))]
    assert len(data) == len(rows) == 512
    assert data[0]["prompt"] == rows[0]["messages"] and data[0]["solution"] == rows[0]["solution"]
    assert data[0]["image"].size == (56, 56) and data[0]["image"].mode == "RGB"
    reward = trl_compare.trl_reward(task)
    completions = [[{"role": "assistant", "content": "x"}]] * 4
    assert reward(completions, solution=["red", "red", "blue", "blue"],
                  completion_ids=[[4], [5], [4], [5]], prompts=None) == [1.0, 0.0, 0.0, 1.0]
    assert reward.__name__ == "colour_parity"


def test_trl_gets_the_math_task_as_ours(tmp_path):
    from grpo_step import build_task

    task = build_task("tiny", str(tmp_path))
    data = trl_compare.trl_dataset(task)
    assert "image" not in data.column_names
    solution = data[0]["solution"]
    completions = [[{"role": "assistant", "content": f"so \\boxed{{{solution}}}"}],
                   [{"role": "assistant", "content": "\\boxed{-1}"}]]
    assert trl_compare.trl_reward(task)(completions, solution=[solution] * 2) == [1.0, 0.0]


def test_the_image_prompt_tokens_trl_renders_are_ours(tiny_model_dir, tmp_path):
    """VL_CHAT_TEMPLATE through the model's processor, on the messages TRL makes of a row (the
    image before the text), gives the token ids ours trains on: the tag ms-swift's way,
    rendered with the model's template, expanded to one pad per merged patch."""
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    from swift_megatron.data.images import ImageEncoder

    model = tiny_model_dir("qwen2_5_vl")
    messages = [{"role": "user", "content": "What colour is the square?"}]
    image = Image.new("RGB", (112, 84), (200, 30, 30))
    encoder = ImageEncoder(model, AutoConfig.from_pretrained(model).to_dict())
    tokenizer = AutoTokenizer.from_pretrained(model)
    grid = encoder.encode([image])["image_grid_thw"]
    text = tokenizer.apply_chat_template(encoder.tag(messages, 1), tokenize=False,
                                         add_generation_prompt=True)
    ours = tokenizer(encoder.expand(text, grid))["input_ids"]
    processor = AutoProcessor.from_pretrained(model)
    processor.chat_template = trl_compare.VL_CHAT_TEMPLATE
    trl_messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": messages[0]["content"]}]}]
    theirs = processor.apply_chat_template(trl_messages, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    pads = int(grid.prod()) // encoder.merge_size ** 2
    assert list(theirs[0]) == ours and ours.count(encoder.image_token_id) == pads == 12


def test_trl_trains_what_ours_trains_of_a_vision_model():
    """Full training freezes the tower and its merger (`visual.`), nothing else; LoRA puts no
    adapter on them (peft's exclude_modules matches each module name whole)."""
    import re

    import torch

    model = torch.nn.Module()
    model.visual = torch.nn.ModuleDict({"blocks": torch.nn.Linear(2, 2),
                                        "merger": torch.nn.Linear(2, 2)})
    model.language_model = torch.nn.Linear(2, 2)
    assert trl_compare.freeze_tower(model) == 4
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "language_model.weight", "language_model.bias"]
    exclude = trl_compare.peft_config(16).exclude_modules
    assert re.fullmatch(exclude, "model.visual.blocks.0.attn.qkv")
    assert not re.fullmatch(exclude, "model.language_model.layers.0.mlp.up_proj")


def test_train_tflops_counts_active_parameters_and_attention(tmp_path):
    """A dense config by hand: 6 x (layers x (attention + MLP) + vocab x hidden) per token, plus
    6 x query width x sequence per full-attention layer."""
    hf = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
              tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    attention = 64 * 16 * (4 + 2 * 2) + 4 * 16 * 64
    params = 2 * (attention + 3 * 64 * 128) + 1000 * 64
    flops = 6 * params + 6 * 64 * 100 * 2
    assert trl_compare.train_tflops(str(tmp_path), 1e6, 100) == pytest.approx(flops * 1e6 / 1e12)
    assert trl_compare.train_tflops(str(tmp_path), None) == 0.0
    # LoRA: the frozen weights get no weight gradient, so 4 x the parameters (attention the same)
    lora = 4 * params + 6 * 64 * 100 * 2
    assert trl_compare.train_tflops(str(tmp_path), 1e6, 100, lora=True) == \
        pytest.approx(lora * 1e6 / 1e12)


@pytest.mark.parametrize("rank, rlhf_args, extra, expected", [
    (0, [], [], False),
    (16, [], [], True),
    (0, ["--train_type", "lora"], [], True),
    (0, [], ["--train_type", "lora", "--lora_dropout", "0"], True),   # a --variant's flags
    (16, [], ["--train_type", "full"], False),                         # the last one wins
])
def test_is_lora_reads_the_runs_flags(rank, rlhf_args, extra, expected):
    a = types.SimpleNamespace(lora=rank, rlhf_args=rlhf_args)
    assert trl_compare.is_lora(a, extra) is expected


def test_variable_length_is_for_text_presets(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["trl_compare.py", "--preset", "tiny-vl",
                                      "--variable_length"])
    with pytest.raises(SystemExit) as exc:
        trl_compare.main()
    assert exc.value.code == 2 and "--variable_length" in capsys.readouterr().err


def test_the_template_renders_text_prompts_as_the_models_own(tiny_model_dir):
    """A text prompt, as a string (tokenizers) or as TRL's text block (a vision-language
    model's processor, Qwen3.5's included, without images), renders as the fixtures' template
    renders the string."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokenizer.chat_template = trl_compare.VL_CHAT_TEMPLATE
    blocks = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in messages]
    for form in (messages, blocks):
        assert tokenizer.apply_chat_template(form, tokenize=False,
                                             add_generation_prompt=True) == own


def test_a_trl_setting_may_change_any_shared_field(monkeypatch):
    """--trl_config's fields win over the shared work's (a sweep of TRL's micro-batch size and
    sleep mode); without it TRL gets the shared work: 64 completions per step in micro-batches
    of 8, two steps per rollout batch of 128, sleep mode on."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    a = argparse.Namespace(work_dir="/w", completion_length=256, rollout_batches=4,
                           trl_config="{}")
    shared = trl_compare.grpo_config_fields(a)
    assert (shared["per_device_train_batch_size"], shared["gradient_accumulation_steps"],
            shared["generation_batch_size"], shared["max_steps"],
            shared["vllm_enable_sleep_mode"]) == (8, 8, 128, 8, True)
    a.trl_config = json.dumps({"per_device_train_batch_size": 32,
                               "gradient_accumulation_steps": 2,
                               "vllm_enable_sleep_mode": False, "gradient_checkpointing": False})
    fields = trl_compare.grpo_config_fields(a)
    assert {k: v for k, v in fields.items() if shared.get(k) != v} == json.loads(a.trl_config)
