#!/usr/bin/env bash
# GRPO on one GPU: Qwen3-0.6B on a math dataset with the accuracy and format rewards, vLLM in
# colocate mode (the engine lives in the training process and sleeps while training).
#
#   bash scripts/grpo/one_gpu.sh [extra megatron rlhf flags]
#   MODEL=/path/to/hf_model DATASET=/path/to/data.jsonl bash scripts/grpo/one_gpu.sh
#
# Batch arithmetic (completion level), one GPU: dp_size = 1
#   global_batch_size 32 = micro_batch_size 4 x dp 1 x 8 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 32 x 4 = 128 completions
#   = 16 prompts x num_generations 8; old-policy logprobs are computed once per rollout.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR#2000}
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} \
megatron rlhf --rlhf_type grpo \
    --model "$MODEL" \
    --dataset "$DATASET" \
    --reward_funcs accuracy format \
    --num_generations 8 \
    --micro_batch_size 4 \
    --global_batch_size 32 \
    --steps_per_generation 4 \
    --max_completion_length 1024 \
    --max_length 2048 \
    --temperature 1.0 \
    --beta 0.04 \
    --lr 1e-6 --lr_warmup_fraction 0.05 \
    --train_iters 200 \
    --save output/grpo_one_gpu --save_steps 50 \
    --log_completions true \
    "$@"
