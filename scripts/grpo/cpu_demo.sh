#!/usr/bin/env bash
# GRPO on a CPU: a tiny random Qwen3 and a synthetic math dataset built locally (nothing is
# downloaded), the embedded transformers rollout engine, two reward functions from a plugin file.
# The reward (fraction of digits) rises within ~30 steps; about a minute on 2 cores.
#
#   bash scripts/grpo/cpu_demo.sh [extra megatron rlhf flags]
#
# Batch arithmetic (completion level), one process: dp_size = 1
#   global_batch_size 64 = micro_batch_size 8 x dp 1 x 8 accumulation steps
#   generation_batch_size = 64 x steps_per_generation 1 = 64 completions = 8 prompts x 8 samples
set -euo pipefail
WORK=${WORK:-demo_output}
python scripts/make_tiny_models.py --output_dir "$WORK" --families qwen3 --dataset_rows 256
megatron rlhf --rlhf_type grpo \
    --model "$WORK/qwen3" \
    --dataset "$WORK/math.jsonl" \
    --external_plugins swift_megatron/demo/rewards.py \
    --reward_funcs digit_ratio contains_answer --reward_weights 1 0 \
    --num_generations 8 \
    --micro_batch_size 8 \
    --global_batch_size 64 \
    --max_completion_length 12 \
    --train_iters 30 \
    --beta 0 \
    --lr 3e-3 --lr_decay_style constant \
    --device cpu \
    --output_dir "$WORK/grpo" \
    "$@"
