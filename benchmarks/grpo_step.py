"""Per-phase time of real GRPO steps (`megatron rlhf`) on a random model of a real shape.

Builds an HF model from a real config.json's values with random weights (bf16 on CUDA) and the
fixture tokenizer (ids beyond its 504 tokens decode to nothing: the rewards stay near 0, which
does not change the work done), a synthetic math dataset, runs `megatron rlhf` for --steps
optimizer steps, then prints one JSON line per step and one with the averages over the steps
after the first (rollout, old/ref logprobs, train, weight sync, tokens/s).

    python benchmarks/grpo_step.py --preset qwen2.5-0.5b --steps 6            # embedded engine
    python benchmarks/grpo_step.py --preset qwen2.5-0.5b -- --use_vllm true --sleep_level 1
    python benchmarks/grpo_step.py --preset tiny --steps 2 -- --device cpu
    NPROC_PER_NODE=2 python benchmarks/grpo_step.py --preset qwen2.5-1.5b -- --train_type lora \
        --tensor_model_parallel_size 2
Arguments after `--` go to `megatron rlhf` unchanged.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from swift_megatron.fixtures.shapes import REAL_SHAPES

PRESETS = {
    "qwen2.5-0.5b": REAL_SHAPES["qwen2.5-0.5b"],
    "qwen2.5-1.5b": REAL_SHAPES["qwen2.5-1.5b"],
    "qwen3-1.7b": REAL_SHAPES["qwen3-1.7b"],
    # built as Qwen3_5ForConditionalGeneration (text stack of this shape, a tiny vision tower)
    "qwen3.5-9b-4l": dict(REAL_SHAPES["qwen3.5-9b-4l"], model_type="qwen3_5"),
    "tiny": dict(model_type="qwen3", vocab_size=504, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
PHASES = ("time/rollout_s", "time/logprobs_s", "time/train_s", "time/sync_s",
          "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "rollout/completion_tokens",
          "rollout/logprob_abs_diff_mean", "perf/max_memory_allocated_gib")


def build_model(preset: str, out_dir: str, dtype: str) -> str:
    from swift_megatron.fixtures import build_tiny_model

    family = PRESETS[preset]["model_type"]
    overrides = {k: v for k, v in PRESETS[preset].items() if k != "model_type"}
    return build_tiny_model(family, out_dir, dtype=dtype, **overrides)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work_dir", default="/tmp/grpo_bench")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--completion_length", type=int, default=256)
    parser.add_argument("--run_name", default="run", help="output directory under --work_dir")
    parser.add_argument("rlhf_args", nargs="*")
    a = parser.parse_args()
    from swift_megatron.fixtures import build_math_dataset

    model = build_model(a.preset, os.path.join(a.work_dir, a.preset), a.dtype)
    dataset = build_math_dataset(os.path.join(a.work_dir, "math.jsonl"), num_rows=512)
    out = os.path.join(a.work_dir, a.run_name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
           "--dataset", dataset, "--reward_funcs", "accuracy", "--num_generations", "8",
           "--micro_batch_size", "8", "--global_batch_size", "64", "--steps_per_generation", "2",
           "--max_completion_length", str(a.completion_length), "--beta", "0.04",
           "--train_iters", str(a.steps), "--report_to", "none", "--logging_steps", "1",
           "--output_dir", out, "--add_version", "false", "--no_save_optim", "true",
           "--save_safetensors", "false", *a.rlhf_args]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, SWIFT_MEGATRON_NO_BAR="1"))
    with open(os.path.join(out, "logging.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        print(json.dumps({"name": "grpo_step", "step": row["step"],
                          **{k: round(row[k], 4) for k in PHASES if k in row}}))
    later = rows[1:] or rows
    print(json.dumps({"name": "grpo_step/mean_after_first", "preset": a.preset, "run": a.run_name,
                      **{k: round(statistics.mean(r[k] for r in later), 4)
                         for k in PHASES if k in later[0]}}))


if __name__ == "__main__":
    main()
