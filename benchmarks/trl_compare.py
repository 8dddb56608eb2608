"""GRPO wall time per rollout batch and peak GPU memory: swift-megatron against TRL's
GRPOTrainer doing the same work on the same GPU, in one run.
Feeds docs/gpu.md, "GRPO against TRL" (and the memory, LoRA, server-mode, multi-turn and
compiled-layer tables: tests/gpu/device_run.sh's trl_*, head_*, lora_train, server and 8B phases).

Both tools get the same random model of a real shape (bf16, `--preset`: grpo_step.py's), the
same 512-row synthetic dataset and reward (grpo_step.build_task: the math task with the accuracy
reward; for the vision-language presets the colour task, one image per prompt, with the
colour_parity reward) and the same work: 16 prompts x 8 completions of at most 256 tokens per
rollout batch, 64 completions per optimizer step in micro-batches of 8, two optimizer steps per
rollout batch, beta 0.04, temperature 1.0, lr 1e-6, vLLM in colocate mode with sleep level 1
(TRL's level-2 sleep call is forced to level 1, as ours; `--sleep_level 2` runs both at 2) and
--vllm_gpu_memory_utilization 0.3.
With --variable_length the model's EOS logit is raised (its output row set along the mean final
hidden state of its own sampled continuations of the prompts, scaled so that EOS takes about
1/64 (`--eos_probability`) of the probability there) and completion lengths spread over 1..256
tokens instead of all hitting 256; reasoning-length completions: `--completion_length 4096
--variable_length --eos_probability 0.002` (most short, a long tail); text presets only.
`--eos_context grid_world` calibrates that EOS on the grid-world environment's first
observations instead of the math prompts (for ours with `--use_gym_env`: multi-turn episodes
whose turns end before the length limit, so that they get a second turn).

With images, TRL gets the same prompt tokens as ours (the image's placeholder before the prompt's
text, VL_CHAT_TEMPLATE) and does the same training: the vision tower and its merger frozen in full
training (ms-swift's --freeze_vit / --freeze_aligner defaults, ours'), no adapter on them with
--lora.

TRL runs in two settings in the same command (`--trl_settings`, both by default): `defaults`,
GRPOConfig as TRL ships it (gradient checkpointing on), and `fastest`, the fastest setting that
fits the GPU: `gradient_checkpointing=False` plus what `--trl_fastest` adds (a JSON object of
GRPOConfig fields, e.g. '{"use_liger_kernel": true}' where liger-kernel is installed: say in
the results which were tried). The ratio lines compare ours with each; the `headline` line is
the ratio against `fastest`.

Both tools' memory is read the same two ways: torch's counter in the tool's process
(`torch_peak_gib`: ours its `perf/max_memory_allocated_gib`, TRL `torch.cuda.max_memory_allocated`)
and the device's used memory as NVML reports it, sampled every 0.2 s by this process while the
tool runs, less what was in use before it started (`device_peak_gib`: vLLM's own allocations
included, whatever allocator made them).

Both tools' phases per rollout batch, as ours logs them: the generation (`time/generate_s`, from
the call to its last completion), its tail (`time/generate_tail_s`, from the moment 90% of the
completions had finished to the last) and the GPU's utilisation during the tail
(`perf/tail_gpu_util`, NVML), timed between vLLM's engine steps (rollout/timeline.py; TRL's
`LLM.generate` wrapped the same way, `TrlPhases`), and the logprob passes (`time/logprobs_s`; TRL:
its forward passes without gradients, between device synchronisations); ours also its train and
sync phases and, with `--tail_logprobs`, the passes run in the tail (`time/tail_logprobs_s`,
`rollout/tail_logprobs_fraction`); TRL the rest of its wall time (`time/train_and_rest_s`:
training, rewards, weight sync).

Each tool runs in its own process; the wall time of rollout batch k is the time between the ends
of rollout batches k-1 and k. The averages leave out the first `--warmup_batches` batches (default
1: the first batch holds the start-up).
Ours runs first, TRL second; `--trl_first` swaps them. The first run on a fresh machine stays
slower for a few batches (on one H200 our rollout phase took 2.04 / 1.83 / 1.58 s over batches
2-4, 1.45 s when run again; TRL 9.2 / 9.1 / 7.0 s against 8.4 s): quote both orders.
One JSON line per rollout batch and tool, one per tool with the averages (and for ours the
per-phase times and the train-phase model FLOP/s against the GPU's dense bf16 peak), and a last
line with the ratios.

    python benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 5
    python benchmarks/trl_compare.py --preset qwen2.5-1.5b --rollout_batches 5 --variable_length
    python benchmarks/trl_compare.py --trl_settings fastest --trl_fastest '{"use_liger_kernel": true}'
    python benchmarks/trl_compare.py --preset qwen3-8b --lora 16   # both tools LoRA (all linears)
    python benchmarks/trl_compare.py --preset qwen2.5-vl-3b   # images (the colour task)
    python benchmarks/trl_compare.py --preset qwen3.5-9b --lora 16   # Gated DeltaNet layers
    python benchmarks/trl_compare.py --tool ours -- --train_type lora   # extra megatron rlhf flags
    python benchmarks/trl_compare.py --nproc 2   # data parallel over 2 GPUs, twice the work
    python benchmarks/trl_compare.py --variant 8k="--max_tokens_per_micro_batch 8192" \
        --variant 16k="--max_tokens_per_micro_batch 16384"   # ours twice, TRL once
    python benchmarks/trl_compare.py --completion_length 4096 --variable_length \
        --eos_probability 0.002 --variant tail="--tail_logprobs true" \
        --variant async="--async_generate true --sleep_level 0"   # reasoning lengths

Each `--variant NAME="FLAGS"` runs ours once more with those flags after the shared extra flags
(one TRL run serves them all; a summary and a ratio line per variant). For every run of ours the
dry run's memory estimate (model/memory.py) is printed next to what was measured: each phase's
peak (`memory/<phase>_peak_gib`) less what the sleeping vLLM engine still holds in torch's counter
(`memory/engine_asleep_gib`), i.e. the training's own memory, against the larger of the
estimate's `train` and `logprobs` phases.

With --nproc N (weak scaling) each tool runs data-parallel over N GPUs of this machine (ours with
NPROC_PER_NODE, TRL under torchrun) and does N times the work per rollout batch: 16N prompts,
64N completions per optimizer step, the same micro-batch per GPU.

TRL is a benchmark-only dependency (requirements/benchmarks.txt).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dry_run_memory import memory_check, memory_estimate  # noqa: E402
from grpo_step import PRESETS, build_model, build_task  # noqa: E402  (the same presets and tasks)

PROMPTS, GENERATIONS, MICRO, GLOBAL, STEPS_PER_ROLLOUT = 16, 8, 8, 64, 2
SETTINGS = dict(beta=0.04, temperature=1.0, lr=1e-6, gpu_memory_utilization=0.3)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}
EOS_PROBABILITY = 1 / 64
# GRPOConfig fields over TRL's defaults per setting (--trl_fastest adds to `fastest`)
TRL_SETTINGS = {"defaults": {}, "fastest": {"gradient_checkpointing": False}}
LORA_DROPOUT = 0.05
# The models' chat template (the fixtures', swift_megatron/fixtures/tokenizer.py) taking content
# lists too, as TRL passes an image prompt: an image block renders as ours renders an image tag
# (before the prompt's text), and the processor expands its <|image_pad|> to the image's patches
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


# ---- the shared inputs ------------------------------------------------------------------------

def grid_world_prompts(count: int = 32) -> list:
    """The chat messages a grid-world episode starts from (builtin.GridWorld.reset), seeds 0..count-1."""
    from swift_megatron.rollout.multi_turn.builtin import GRID_SYSTEM, GridWorld
    from swift_megatron.rollout.multi_turn.protocol import Episode

    prompts = []
    for seed in range(count):
        observation, _, system = GridWorld({"seed": seed}).reset(Episode([], prompt_id=seed))
        prompts.append([{"role": "system", "content": system or GRID_SYSTEM},
                        {"role": "user", "content": observation}])
    return prompts


def raise_eos(model_dir: str, prompts: list, probability: float = EOS_PROBABILITY) -> float:
    """Set the EOS output row along the mean final hidden state of the model's own sampled
    continuations of `prompts` (chat messages), scaled so that EOS gets about `probability`
    there; returns the probability measured on those contexts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for m in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left").to("cuda")
    with torch.no_grad():
        sequences = model.generate(**batch, do_sample=True, max_new_tokens=128,
                                   pad_token_id=eos, eos_token_id=None)
        hidden = model(sequences, output_hidden_states=True).hidden_states[-1]
    hidden = hidden[:, batch["input_ids"].shape[1]:].float()  # the sampled contexts only
    direction = hidden.mean(dim=(0, 1))
    direction = direction / direction.norm()
    head = model.get_output_embeddings().weight

    def eos_probability(scale: float) -> float:
        with torch.no_grad():
            head[eos] = (scale * direction).to(head.dtype)
            logits = model.lm_head(hidden.to(head.dtype)).float()
        return torch.softmax(logits, -1)[..., eos].mean().item()

    low, high = 0.0, 1.0
    while eos_probability(high) < probability:
        high *= 2
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if eos_probability(middle) < probability else (low, middle)
    measured = eos_probability(high)
    model.save_pretrained(model_dir)
    return measured


def prepare(a) -> tuple:
    """The preset's random model and its task's flags (grpo_step.build_task: the dataset, its
    reward and the reward's plugin): the math task for text presets, the colour-image task for
    the vision-language ones."""
    model = build_model(a.preset, os.path.join(a.work_dir, a.preset), "bfloat16")
    task = build_task(a.preset, a.work_dir)
    if a.variable_length:
        if a.eos_context == "grid_world":   # the episodes' own first turns
            prompts = grid_world_prompts()
        else:
            with open(task_value(task, "--dataset")) as f:
                prompts = [json.loads(line)["messages"] for line in f][:32]
        emit(name="eos_raised", context=a.eos_context,
             probability=round(raise_eos(model, prompts, a.eos_probability), 4))
    return model, task


def task_value(task: list, flag: str):
    """The value `flag` has among a task's flags, None without it."""
    return task[task.index(flag) + 1] if flag in task else None


# ---- ours -------------------------------------------------------------------------------------

def ours_command(a, model: str, task: list, out: str, extra: list) -> list:
    """Ours on the workload; `a.free_layout` (auto_grid.py): no layout flag of its own."""
    return [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
            *task, "--num_generations",
            str(GENERATIONS), "--micro_batch_size", str(MICRO), "--global_batch_size",
            str(GLOBAL * a.nproc), "--steps_per_generation", str(STEPS_PER_ROLLOUT),
            "--max_completion_length", str(a.completion_length), "--beta", str(SETTINGS["beta"]),
            "--temperature", str(SETTINGS["temperature"]), "--lr", str(SETTINGS["lr"]),
            "--lr_decay_style", "constant", "--train_iters",
            str(a.rollout_batches * STEPS_PER_ROLLOUT), "--use_vllm", "true", "--vllm_mode",
            "colocate", "--sleep_level", str(a.sleep_level), "--vllm_gpu_memory_utilization",
            str(SETTINGS["gpu_memory_utilization"]),
            *([] if getattr(a, "free_layout", False) else ["--recompute_granularity", "none"]),
            "--logging_steps", "1", "--report_to", "none", "--output_dir", out,
            "--add_version", "false", "--save_safetensors", "false", "--no_save_optim", "true",
            *lora_flags(getattr(a, "lora", 0)), *a.rlhf_args, *extra]


def is_lora(a, extra) -> bool:
    """Whether a run of ours trains LoRA adapters: --lora, or `--train_type lora` among the
    extra flags (the last one given wins, as on the command line)."""
    flags = [*lora_flags(getattr(a, "lora", 0)), *a.rlhf_args, *extra]
    kinds = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--train_type"]
    return bool(kinds) and kinds[-1] == "lora"


def lora_flags(rank: int) -> list:
    """--lora RANK for ours: ms-swift's all-linear targets, alpha 2 x rank, dropout 0.05 (its
    default; TRL gets the same adapter through peft)."""
    return [] if not rank else ["--train_type", "lora", "--lora_rank", str(rank), "--lora_alpha",
                                str(2 * rank), "--lora_dropout", str(LORA_DROPOUT)]


def run_ours(a, model: str, task: list, label: str = "ours", extra: list = ()) -> dict:
    out = os.path.join(a.work_dir, label)
    shutil.rmtree(out, ignore_errors=True)
    cmd = ours_command(a, model, task, out, list(extra))
    env = dict(os.environ, SWIFT_MEGATRON_NO_BAR="1", NPROC_PER_NODE=str(a.nproc))
    estimate = memory_estimate(cmd, env)
    with DevicePeak() as device:
        subprocess.run(cmd, check=True, env=env)
    with open(os.path.join(out, "logging.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    walls = batch_walls([row["time"] for row in rows])
    for k, (row, wall) in enumerate(zip(rows[1:], walls), start=2):
        emit(name="rollout_batch", tool=label, batch=k, wall_s=round(wall, 3),
             **{key: round(value, 4) for key, value in row.items()
                if key in PHASE_KEYS or key.startswith("memory/")})
    walls, later = measured(walls, a.warmup_batches), measured(rows[1:], a.warmup_batches)
    peak = max(r.get("perf/max_memory_allocated_gib") or 0 for r in rows)
    summary = dict(wall_s=statistics.mean(walls), peak_gib=peak, torch_peak_gib=peak,
                   device_peak_gib=device.peak_gib,
                   completion_tokens=statistics.mean(r["rollout/completion_tokens"] for r in later))
    summary.update({key: statistics.mean(r[key] for r in later) for key in PHASE_KEYS
                    if all(r.get(key) is not None for r in later)})
    summary["train_tflops"] = train_tflops(model, summary.get("perf/train_tokens_per_s"),
                                           summary.get("rollout/completion_length_mean", 0.0),
                                           lora=is_lora(a, extra))
    peak_tflops = bf16_peak_tflops()
    if peak_tflops:
        summary["train_mfu"] = summary["train_tflops"] / peak_tflops
    summary.update(memory_check(rows, estimate))
    return summary


PHASE_KEYS = ("time/rollout_s", "time/logprobs_s", "time/train_s", "time/sync_s",
              "time/sync_check_s", "time/generate_s", "time/generate_tail_s",
              "perf/tail_gpu_util", "time/tail_logprobs_s", "rollout/tail_passes",
              "rollout/tail_logprobs_fraction", "rollout/staleness",
              "perf/gc_pause_s", "perf/rollout_tokens_per_s",
              "perf/train_tokens_per_s",
              "perf/max_memory_allocated_gib", "rollout/logprob_abs_diff_mean",
              "sync/logprob_abs_diff_mean",
              "rollout/completion_tokens", "rollout/completion_length_mean",
              "multi_turn/num_turns_mean", "multi_turn/env_tokens_mean")  # the last two: multi-turn runs


def train_tflops(model_dir: str, tokens_per_s, sequence_tokens: float = 0.0,
                 lora: bool = False) -> float:
    """Model FLOP/s of the train phase, in TFLOP/s: per token, forward + backward of what it
    multiplies by (6 x planning/cost.py's active_parameters: MoE layers' routed experts only,
    the output head included; with `lora` 4 x, as frozen weights get no weight gradient, the
    adapters' few FLOPs left out) and the causal attention products of the full-attention
    layers at `sequence_tokens` (attention_flops_per_token; the run passes the completions'
    mean length, its prompts left out: 24 tokens of the math task, about 285 with an image;
    Gated DeltaNet layers' recurrence and a vision tower left out)."""
    from swift_megatron.planning.cost import active_parameters, attention_flops_per_token

    if not tokens_per_s:
        return 0.0
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    per_token = (4 if lora else 6) * active_parameters(hf) + \
        attention_flops_per_token(hf, int(sequence_tokens))
    return per_token * tokens_per_s / 1e12


def bf16_peak_tflops():
    """GPU 0's dense bf16 peak in TFLOP/s (PEAK_BF16_TFLOPS by its name), None when unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                              "--id=0"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if name in out.stdout), None)


# ---- TRL --------------------------------------------------------------------------------------

def trl_command(a, model: str, task: list, setting: str = "defaults") -> list:
    """The TRL worker's command line, under torchrun with --nproc > 1. The worker takes its
    world size from torchrun's WORLD_SIZE: an option named like one of torchrun's own (`--nproc`)
    anywhere on its line is refused by torchrun as ambiguous (seen on 2 GPUs)."""
    launcher = [sys.executable] if a.nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc)]
    return [*launcher, os.path.abspath(__file__), "--trl_worker", "--model_dir", model,
            "--task", json.dumps(task), "--work_dir", a.work_dir, "--rollout_batches",
            str(a.rollout_batches), "--completion_length", str(a.completion_length),
            "--sleep_level", str(a.sleep_level), "--lora", str(getattr(a, "lora", 0)),
            "--trl_setting", setting,
            "--trl_config", json.dumps(trl_overrides(a, setting))]


def trl_overrides(a, setting: str) -> dict:
    """The GRPOConfig fields `setting` changes from TRL's defaults."""
    extra = json.loads(getattr(a, "trl_fastest", None) or "{}") if setting == "fastest" else {}
    return {**TRL_SETTINGS[setting], **extra}


def run_trl(a, model: str, task: list, setting: str = "defaults") -> dict:
    log = trl_log(a.work_dir, setting)
    if os.path.exists(log):
        os.remove(log)
    with DevicePeak() as device:
        subprocess.run(trl_command(a, model, task, setting), check=True)
    with open(log) as f:
        steps = [json.loads(line) for line in f]
    ends = [s for s in steps if s["step"] % STEPS_PER_ROLLOUT == 0]
    walls = batch_walls([end["time"] for end in ends])
    tool = f"trl_{setting}"
    for k, (end, wall) in enumerate(zip(ends[1:], walls), start=2):
        emit(name="rollout_batch", tool=tool, batch=k, wall_s=round(wall, 3),
             peak_gib=round(end["peak_gib"], 2), completion_length_mean=end["completion_length_mean"],
             **{key: round(end[key], 4) for key in PHASE_KEYS if end.get(key) is not None})
    peak, later = max(s["peak_gib"] for s in ends), measured(ends[1:], a.warmup_batches)
    phases = {key: statistics.mean(e[key] for e in later) for key in PHASE_KEYS
              if later and all(e.get(key) is not None for e in later)}
    wall = statistics.mean(measured(walls, a.warmup_batches))
    if "time/generate_s" in phases and "time/logprobs_s" in phases:
        phases["time/train_and_rest_s"] = wall - phases["time/generate_s"] - phases["time/logprobs_s"]
    return dict(wall_s=wall, peak_gib=peak, torch_peak_gib=peak, device_peak_gib=device.peak_gib,
                config=trl_overrides(a, setting), **phases)


def trl_log(work_dir: str, setting: str) -> str:
    return os.path.join(work_dir, f"trl_steps_{setting}.jsonl")


class DevicePeak:
    """The largest device memory in use (NVML, all processes) while the block runs, less what
    was in use when it began, in GiB (`peak_gib`; None where NVML cannot be read)."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s, self.peak_gib = interval_s, None
        self._stop = threading.Event()

    def __enter__(self):
        self._base = device_used_gib()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        top = None
        while not self._stop.wait(self.interval_s):
            used = device_used_gib()
            top = used if top is None or (used is not None and used > top) else top
        if top is not None and self._base is not None:
            self.peak_gib = top - self._base

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def device_used_gib():
    """GPU 0's used memory as NVML reports it (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits", "--id=0"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() \
        else None


def batch_walls(ends: list) -> list:
    """The wall time of rollout batches 2.. from the times their ends were logged."""
    return [b - a_ for a_, b in zip(ends, ends[1:])]


def measured(per_batch: list, warmup_batches: int) -> list:
    """The entries of batches warmup_batches + 1.. of a list that starts at batch 2 (`batch_walls`,
    the rows after the first)."""
    return per_batch[warmup_batches - 1:]


def trl_dataset(task: list):
    """TRL's train_dataset for the task: the conversational prompts, the reward's `solution`
    column and, for the image task, an `image` column (its path, decoded to a PIL image when
    read) that TRL puts before the prompt's text, where ours puts it too."""
    from datasets import Dataset, Image
    from datasets.table import InMemoryTable

    with open(task_value(task, "--dataset")) as f:
        rows = [json.loads(line) for line in f]
    columns = [{"prompt": r["messages"], "solution": r["solution"],
                **({"image": r["images"][0]} if r.get("images") else {})} for r in rows]
    # a fixed fingerprint: datasets 5.2 cannot hash pyarrow 26's MonthDayNano type with dill
    data = Dataset(InMemoryTable.from_pylist(columns), fingerprint="trl_compare")
    return data.cast_column("image", Image()) if "image" in columns[0] else data


def trl_reward(task: list):
    """The task's reward (--reward_funcs, from --external_plugins where it names one) as TRL
    calls a reward function: completions as chat messages, the dataset's columns as keywords."""
    from swift_megatron.rewards import RewardConfig, resolve_reward_funcs
    from swift_megatron.rewards.plugins import load_plugins

    name, plugin = task_value(task, "--reward_funcs"), task_value(task, "--external_plugins")
    (_, func), = resolve_reward_funcs([name], load_plugins([plugin] if plugin else []),
                                     RewardConfig())

    def reward(completions, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return func(texts, **kwargs)

    reward.__name__ = name
    return reward


def freeze_tower(model) -> int:
    """Freeze a vision-language model's vision tower, its merger included, as ours does in full
    training (ms-swift's --freeze_vit and --freeze_aligner true); returns the tensors frozen."""
    frozen = [p for name, p in model.named_parameters() if "visual." in name]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


def grpo_config_fields(a) -> dict:
    """The TRL worker's GRPOConfig fields: the shared work (the module docstring), then the
    setting's fields (--trl_config: `trl_overrides`) over them."""
    config = dict(
        output_dir=os.path.join(a.work_dir, "trl"), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GLOBAL // MICRO, num_generations=GENERATIONS,
        generation_batch_size=GLOBAL * int(os.environ.get("WORLD_SIZE", 1)) * STEPS_PER_ROLLOUT,
        max_completion_length=a.completion_length,
        beta=SETTINGS["beta"], temperature=SETTINGS["temperature"],
        learning_rate=SETTINGS["lr"], lr_scheduler_type="constant", loss_type="grpo", bf16=True,
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=SETTINGS["gpu_memory_utilization"],
        vllm_importance_sampling_correction=False,  # ours has no importance correction here
        max_steps=a.rollout_batches * STEPS_PER_ROLLOUT, logging_steps=1, report_to=[],
        save_strategy="no", seed=42)
    return {**config, **json.loads(a.trl_config)}


def trl_worker(a) -> None:
    """TRL's GRPOTrainer on the same model, data and settings (runs in its own process)."""
    import torch
    import vllm
    from transformers import AutoProcessor, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    original_sleep = vllm.LLM.sleep   # TRL sleeps at level 2: ours and TRL's at --sleep_level
    vllm.LLM.sleep = lambda self, level=1: original_sleep(self, level=a.sleep_level)
    phases = TrlPhases()
    phases.install(vllm.LLM, GRPOTrainer)
    task = json.loads(a.task)
    log = trl_log(a.work_dir, a.trl_setting)
    cuda = torch.cuda.is_available()

    class Timer(TrainerCallback):
        length = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.length = (logs or {}).get("completions/mean_length", self.length)

        def on_step_end(self, args, state, control, **kwargs):
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            if cuda and state.global_step % STEPS_PER_ROLLOUT == 0:
                torch.cuda.reset_peak_memory_stats()
            if not state.is_world_process_zero:
                return
            ends_batch = state.global_step % STEPS_PER_ROLLOUT == 0
            with open(log, "a") as f:
                f.write(json.dumps(dict(step=state.global_step, time=time.time(), peak_gib=peak,
                                        completion_length_mean=self.length,
                                        **(phases.take() if ends_batch else {}))) + "\n")

    data = trl_dataset(task)
    # as TRL loads it; a model directory without an image processor (the text Qwen3.5 presets:
    # a tower in the config, no images) gets its tokenizer, where TRL's AutoProcessor would fail
    images = os.path.exists(os.path.join(a.model_dir, "preprocessor_config.json"))
    processor = (AutoProcessor if images else AutoTokenizer).from_pretrained(
        a.model_dir, truncation_side="left", padding_side="left")
    # a vision-language model's processor gets content lists even without images (TRL's
    # prepare_multimodal_messages); plain strings render as the models' own template renders them
    processor.chat_template = VL_CHAT_TEMPLATE
    trainer = GRPOTrainer(model=a.model_dir, reward_funcs=[trl_reward(task)],
                          args=GRPOConfig(**grpo_config_fields(a)),
                          train_dataset=data, processing_class=processor, callbacks=[Timer()],
                          peft_config=peft_config(a.lora))
    if not a.lora:
        freeze_tower(trainer.model)   # the tower of a vision-language model (Qwen3.5's too)
    trainer.train()


class TrlPhases:
    """TRL's phases as ours logs them, summed per rollout batch (`take`): its generation
    (vLLM's `LLM.generate`, timed between vLLM's engine steps by swift-megatron's
    GenerationClock: `time/generate_s`, `time/generate_tail_s` from 90% of the completions
    finished to the last, `perf/tail_gpu_util`) and its logprob passes (`time/logprobs_s`: the
    forward passes GRPOTrainer runs without gradients, the reference's and the old policy's,
    each between two device synchronisations)."""

    def __init__(self):
        self.generations, self.logprobs_s = [], 0.0

    def install(self, llm_class, trainer_class) -> None:
        generate, logprobs = llm_class.generate, trainer_class._get_per_token_logps_and_entropies

        def timed_generate(llm, prompts, *args, **kwargs):
            from swift_megatron.rollout.timeline import GenerationClock
            from swift_megatron.rollout.vllm_compat import finished_requests

            clock = GenerationClock(len(prompts) if isinstance(prompts, list) else 1)
            with finished_requests(llm, lambda done: clock.step(len(done))):
                outputs = generate(llm, prompts, *args, **kwargs)
            self.generations += [clock.times()] if clock.finishes else []
            return outputs

        def timed_logprobs(trainer, *args, **kwargs):
            import torch

            if torch.is_grad_enabled():   # the loss's own forward, not a logprob pass
                return logprobs(trainer, *args, **kwargs)
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            start = time.perf_counter()
            result = logprobs(trainer, *args, **kwargs)
            sync()
            self.logprobs_s += time.perf_counter() - start
            return result

        llm_class.generate, trainer_class._get_per_token_logps_and_entropies = \
            timed_generate, timed_logprobs

    def take(self) -> dict:
        from swift_megatron.rollout.timeline import timing_metrics

        found = dict(timing_metrics(self.generations), **{"time/logprobs_s": self.logprobs_s})
        self.generations, self.logprobs_s = [], 0.0
        return found


def peft_config(rank: int):
    """TRL's adapter for --lora RANK: the one lora_flags gives ours (every linear layer of the
    language model; ours never adapts a vision tower)."""
    if not rank:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=LORA_DROPOUT,
                      target_modules="all-linear", task_type="CAUSAL_LM",
                      exclude_modules=r".*visual\..*")


# ---- the comparison ---------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS),
                        help="benchmarks/grpo_step.py's model shapes; the vision-language ones "
                             "train on the colour-image task, the others on the math task")
    parser.add_argument("--rollout_batches", type=int, default=5)
    parser.add_argument("--warmup_batches", type=int, default=1,
                        help="the first rollout batches left out of the averages (at least 1, "
                             "fewer than --rollout_batches)")
    parser.add_argument("--completion_length", type=int, default=256)
    parser.add_argument("--variable_length", action="store_true")
    parser.add_argument("--eos_probability", type=float, default=EOS_PROBABILITY,
                        help="--variable_length: EOS's probability per token (lengths about "
                             "geometric, mean 1/p: 1/512 with --completion_length 4096 gives "
                             "reasoning-like lengths, median ~355, 1%% past ~2360)")
    parser.add_argument("--eos_context", default="dataset", choices=["dataset", "grid_world"],
                        help="--variable_length: the prompts the EOS is calibrated on")
    parser.add_argument("--tool", default="both", choices=["both", "ours", "trl"])
    parser.add_argument("--trl_first", action="store_true",
                        help="run TRL before ours (the first run on a fresh machine is slower)")
    parser.add_argument("--sleep_level", type=int, default=1, choices=[1, 2],
                        help="vLLM's sleep level for both tools (issue 10's setup: 1; TRL's own "
                             "default and ms-swift's scripts: 2)")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs, data parallel")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="both tools train a LoRA adapter of this rank on every linear "
                             "layer (0: full parameters)")
    parser.add_argument("--trl_settings", nargs="+", default=list(TRL_SETTINGS),
                        choices=list(TRL_SETTINGS), help="TRL's settings to run (both: one "
                        "command, the same machine)")
    parser.add_argument("--trl_fastest", default="{}",
                        help="a JSON object of GRPOConfig fields the `fastest` setting adds")
    parser.add_argument("--work_dir", default="/tmp/trl_compare")
    parser.add_argument("--trl_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", help=argparse.SUPPRESS)
    parser.add_argument("--task", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--trl_setting", default="defaults", help=argparse.SUPPRESS)
    parser.add_argument("--trl_config", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                        help="run ours again with these extra flags (repeatable)")
    parser.add_argument("rlhf_args", nargs="*")
    a = parser.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    if not 1 <= a.warmup_batches < a.rollout_batches:
        parser.error(f"--warmup_batches {a.warmup_batches} must be at least 1 and less than "
                     f"--rollout_batches {a.rollout_batches}")
    if a.variable_length and "image_size" in PRESETS.get(a.preset, {}):
        parser.error(f"--variable_length calibrates the EOS on text prompts: --preset "
                     f"{a.preset} is a vision-language preset")
    os.makedirs(a.work_dir, exist_ok=True)
    model, task = prepare(a)
    results = {}
    for tool in ("trl", "ours") if a.trl_first else ("ours", "trl"):
        if a.tool in ("both", tool):
            (run_all_ours if tool == "ours" else run_trl_once)(a, model, task, results)
    emit_ratios(a, results)


def emit_ratios(a, results: dict) -> None:
    """A ratio line per run of ours and TRL setting; `headline`: ours against TRL's fastest
    setting (the slowest of those run when `fastest` was not)."""
    trls = {label: r for label, r in results.items() if label.startswith("trl_")}
    ours = {label: r for label, r in results.items() if not label.startswith("trl_")}
    for label, mine in ours.items():
        for trl_label, trl in trls.items():
            emit(name="ratio", tool=label, baseline=trl_label, variable_length=a.variable_length,
                 nproc=a.nproc, **ratios(mine, trl))
    if "ours" in ours and trls:
        best = trls.get("trl_fastest") or min(trls.values(), key=lambda r: r["wall_s"])
        emit(name="headline", baseline="trl_fastest" if "trl_fastest" in trls else "trl",
             **ratios(ours["ours"], best))


def ratios(mine: dict, trl: dict) -> dict:
    """Speed (TRL's wall over ours) and memory (ours over TRL's), by each measure both have."""
    found = {"speedup_vs_trl": round(trl["wall_s"] / mine["wall_s"], 3),
             "memory_vs_trl": round(mine["peak_gib"] / trl["peak_gib"], 3)}
    if mine.get("device_peak_gib") and trl.get("device_peak_gib"):
        found["device_memory_vs_trl"] = round(mine["device_peak_gib"] / trl["device_peak_gib"], 3)
    return found


def run_all_ours(a, model: str, task: list, results: dict) -> None:
    """Ours, then each --variant, into `results` by label, a summary line each."""
    for label, extra in [("ours", [])] + [parse_variant(v) for v in a.variant]:
        try:
            results[label] = run_ours(a, model, task, label, extra)
        except subprocess.CalledProcessError as exc:   # e.g. out of memory: the rest still runs
            emit(name="failed", tool=label, returncode=exc.returncode)
            continue
        emit(name="summary", tool=label, nproc=a.nproc, warmup_batches=a.warmup_batches,
             **rounded(results[label]))


def run_trl_once(a, model: str, task: list, results: dict) -> None:
    """Each of --trl_settings, into `results` as trl_<setting>, a summary line each."""
    for setting in a.trl_settings:
        label = f"trl_{setting}"
        try:
            results[label] = run_trl(a, model, task, setting)
        except subprocess.CalledProcessError as exc:   # e.g. out of memory: the rest still runs
            emit(name="failed", tool=label, returncode=exc.returncode)
            continue
        emit(name="summary", tool=label, nproc=a.nproc, warmup_batches=a.warmup_batches,
             **rounded(results[label]))


def parse_variant(text: str) -> tuple:
    label, _, flags = text.partition("=")
    if not label or not flags or label in ("ours", "trl"):
        raise SystemExit(f"--variant {text!r}: expected NAME=\"FLAGS\" (NAME not ours/trl)")
    return label, flags.split()


def rounded(values: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}


if __name__ == "__main__":
    main()
