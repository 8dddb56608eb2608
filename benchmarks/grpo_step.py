"""Per-phase time of real GRPO steps (`megatron rlhf`) on a random model of a real shape.
Feeds docs/gpu.md, "Qwen3.5, MoE and vision-language models with vLLM" (device_run.sh's
qwen3_5_vllm, qwen3_5_moe_vllm, moe_ep2, vl_grpo, tp2_colocate); its presets are every benchmark's
and the GPU gate's.

Builds an HF model from a real config.json's values with random weights (bf16 on CUDA) and the
fixture tokenizer (ids beyond its 504 tokens decode to nothing: the rewards stay near 0, which
does not change the work done), a synthetic math dataset, runs `megatron rlhf` for --steps
optimizer steps, then prints one JSON line per step and one with the averages over the steps
after the first (rollout, old/ref logprobs, train, weight sync, tokens/s).

The vision-language presets (qwen2.5-vl-3b, tiny-vl) build a Qwen2.5-VL checkpoint with the
fixtures' image processor and vision tokens, and the colour-square image task instead
(fixtures `build_colour_dataset`, `colour_parity` reward of swift_megatron/demo/rewards.py);
qwen2.5-vl-3b's 448x448 images are 256 image tokens each, through the 32-block tower.

    python benchmarks/grpo_step.py --preset qwen2.5-0.5b --steps 6            # embedded engine
    python benchmarks/grpo_step.py --preset qwen2.5-0.5b -- --use_vllm true --sleep_level 1
    python benchmarks/grpo_step.py --preset tiny --steps 2 -- --device cpu
    python benchmarks/grpo_step.py --preset qwen2.5-vl-3b -- --use_vllm true --sleep_level 1
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

from swift_megatron.fixtures.shapes import QWEN3_5_VISION, REAL_SHAPES

PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "swift_megatron",
                      "demo", "rewards.py")
# image_size: the colour images' side in pixels, for the vision-language presets only
PRESETS = {
    "qwen2.5-0.5b": REAL_SHAPES["qwen2.5-0.5b"],
    "qwen2.5-1.5b": REAL_SHAPES["qwen2.5-1.5b"],
    "qwen3-1.7b": REAL_SHAPES["qwen3-1.7b"],
    "qwen3-8b": REAL_SHAPES["qwen3-8b"],
    # built as Qwen3_5ForConditionalGeneration (text stack of this shape, a tiny vision tower)
    "qwen3.5-9b-4l": dict(REAL_SHAPES["qwen3.5-9b-4l"], model_type="qwen3_5"),
    # every layer of Qwen3.5-9B (24 Gated DeltaNet, 8 attention)
    "qwen3.5-9b": dict(REAL_SHAPES["qwen3.5-9b-4l"], model_type="qwen3_5", num_hidden_layers=32),
    # Qwen3.5-35B-A3B's layer shape with 8 layers (64 experts, 8 active, a shared expert)
    "qwen3.5-moe-8l": dict(REAL_SHAPES["qwen3.5-moe-small"], model_type="qwen3_5_moe"),
    "tiny": dict(model_type="qwen3", vocab_size=504, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen2.5-vl-3b": dict(REAL_SHAPES["qwen2.5-vl-3b"], image_size=448),
    # its text stack as a text model (Qwen2, 1-D rope): the per-token cost the images add
    "qwen2.5-3b-text": dict({k: v for k, v in REAL_SHAPES["qwen2.5-vl-3b"].items()
                             if k not in ("vision_config", "rope_parameters")},
                            model_type="qwen2"),
    # the GPU gate's models (tests/gpu/matrix.py): real layer widths, 4 decoder layers (three
    # Gated DeltaNet and one attention for Qwen3.5), 4 vision blocks keeping each tower's
    # pattern (a full-attention block, deepstack taps)
    "llama3.2-1b-4l": dict(REAL_SHAPES["llama3.2-1b"], num_hidden_layers=4),
    "qwen2.5-1.5b-4l": dict(REAL_SHAPES["qwen2.5-1.5b"], num_hidden_layers=4),
    "qwen3-1.7b-4l": dict(REAL_SHAPES["qwen3-1.7b"], num_hidden_layers=4),
    "qwen3-moe-4l": dict(REAL_SHAPES["qwen3-moe-small"], num_hidden_layers=4),
    # Qwen3-30B-A3B's layers with all of its 128 experts (8 of its 48 layers)
    "qwen3-30b-a3b-8l": dict(REAL_SHAPES["qwen3-moe-small"], num_experts=128),
    # Qwen3.5-35B-A3B's layers with all of its 256 experts (8 of its 40 layers)
    "qwen3.5-35b-a3b-8l": dict(REAL_SHAPES["qwen3.5-moe-small"], model_type="qwen3_5_moe",
                               num_experts=256),
    "qwen3.5-moe-4l": dict(REAL_SHAPES["qwen3.5-moe-small"], model_type="qwen3_5_moe",
                           num_hidden_layers=4),
    "qwen2.5-vl-3b-4l": dict(REAL_SHAPES["qwen2.5-vl-3b"], num_hidden_layers=4, image_size=448,
                             vision_config=dict(REAL_SHAPES["qwen2.5-vl-3b"]["vision_config"],
                                                depth=4, fullatt_block_indexes=[3])),
    "qwen3-vl-2b-4l": dict(REAL_SHAPES["qwen3-vl-2b"], num_hidden_layers=4, image_size=448,
                           vision_config=dict(REAL_SHAPES["qwen3-vl-2b"]["vision_config"],
                                              depth=4, deepstack_visual_indexes=[1, 2, 3])),
    "qwen3.5-9b-4l-vl": dict(REAL_SHAPES["qwen3.5-9b-4l"], model_type="qwen3_5", image_size=448,
                             vision_config=dict(QWEN3_5_VISION, depth=4)),
    # the fixture's two-block tower; head_dim 32, vLLM's CPU minimum. The real vocab size makes
    # a sampled <|image_pad|> rare (1 in 151936 tokens): the trainer counts every image pad of
    # a sequence, completions' included, against the images' embeddings and stops on a mismatch
    "tiny-vl": dict(model_type="qwen2_5_vl", vocab_size=151936, hidden_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                    initializer_range=0.1, image_size=56, rope_parameters={
                        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}),
}
PHASES = ("time/rollout_s", "time/logprobs_s", "time/train_s", "time/sync_s",
          "time/sync_check_s",
          "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "rollout/completion_tokens",
          "rollout/logprob_abs_diff_mean", "sync/logprob_abs_diff_mean", "reward/mean",
          "perf/max_memory_allocated_gib")


def build_model(preset: str, out_dir: str, dtype: str, device: str = "cpu") -> str:
    """`preset`'s random checkpoint in `out_dir`, its weights drawn on `device`."""
    from swift_megatron.fixtures import build_tiny_model

    family = PRESETS[preset]["model_type"]
    overrides = {k: v for k, v in PRESETS[preset].items() if k not in ("model_type", "image_size")}
    if "image_size" in PRESETS[preset]:
        overrides["max_pixels"] = PRESETS[preset]["image_size"] ** 2
        if family in ("qwen3_5", "qwen3_5_moe"):   # vision tokens and processor on request
            overrides["images"] = True
    return build_tiny_model(family, out_dir, dtype=dtype, device=device, **overrides)


def build_task(preset: str, work_dir: str) -> list:
    """The dataset (built under `work_dir`) and reward flags of `preset`'s task."""
    from swift_megatron.fixtures import build_colour_dataset, build_math_dataset

    size = PRESETS[preset].get("image_size")
    if size is None:
        return ["--dataset", build_math_dataset(os.path.join(work_dir, "math.jsonl"), num_rows=512),
                "--reward_funcs", "accuracy"]
    path = os.path.join(work_dir, f"colours_{size}", "colours.jsonl")
    return ["--dataset", build_colour_dataset(path, num_rows=512, size=size),
            "--external_plugins", os.path.normpath(PLUGIN), "--reward_funcs", "colour_parity"]


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
    model = build_model(a.preset, os.path.join(a.work_dir, a.preset), a.dtype)
    task = build_task(a.preset, a.work_dir)
    out = os.path.join(a.work_dir, a.run_name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model, *task,
           "--num_generations", "8",
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
                          **{k: float(f"{row[k]:.4g}") for k in PHASES if k in row}}))
    later = rows[1:] or rows
    print(json.dumps({"name": "grpo_step/mean_after_first", "preset": a.preset, "run": a.run_name,
                      **{k: float(f"{statistics.mean(r[k] for r in later):.4g}")
                         for k in PHASES if k in later[0]}}))


if __name__ == "__main__":
    main()
