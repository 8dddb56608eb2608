#!/usr/bin/env bash
# Multi-turn GRPO on a CPU: a tiny random Qwen3 learns a two-turn tool task (docs/multi_turn.md).
# The demo scheduler lookup_tool (swift_megatron/demo/multi_turn.py) answers the model's first
# turn with the row's solution as a tool message; the second turn is scored (contains_answer,
# digit_ratio from swift_megatron/demo/rewards.py). The tool's tokens sit between the turns with
# no loss weight. Nothing is downloaded; a minute or two on 2 cores.
#
#   bash scripts/grpo/cpu_multi_turn.sh [extra megatron rlhf flags]
#
# Batch arithmetic (completion level), one process: dp_size = 1
#   global_batch_size 32 = micro_batch_size 8 x dp 1 x 4 accumulation steps
#   generation_batch_size = 32 completions = 8 prompts x 4 samples, two model turns each
set -euo pipefail
WORK=${WORK:-demo_output}
python scripts/make_tiny_models.py --output_dir "$WORK" --families qwen3 --dataset_rows 256
megatron rlhf --rlhf_type grpo \
    --model "$WORK/qwen3" \
    --dataset "$WORK/math.jsonl" \
    --external_plugins swift_megatron/demo/rewards.py swift_megatron/demo/multi_turn.py \
    --multi_turn_scheduler lookup_tool \
    --max_turns 2 \
    --reward_funcs contains_answer digit_ratio \
    --num_generations 4 \
    --micro_batch_size 8 \
    --global_batch_size 32 \
    --max_completion_length 8 \
    --max_length 128 \
    --train_iters 40 \
    --logging_steps 1 \
    --beta 0 \
    --lr 3e-3 --lr_decay_style constant \
    --log_completions true \
    --device cpu \
    --output_dir "$WORK/grpo_multi_turn" \
    "$@"
