#!/usr/bin/env bash
# LoRA GRPO on two GPUs: Qwen2.5-1.5B-Instruct with tensor parallelism 2; only the adapters
# train (rank 16 on every linear), the reference model is the same model with its adapters
# disabled (no second copy in memory), and the rollout engine receives merged weights.
# Writes PEFT adapters (every checkpoint's adapter/ and output_dir/final_adapter) and the merged
# HF model (output_dir/final_hf).
#
#   bash scripts/grpo/lora_two_gpus_tp2.sh [extra megatron rlhf flags]
#
# Batch arithmetic (completion level), world 2:
#   dp_size = 2 / (TP 2 x PP 1) = 1
#   global_batch_size 32 = micro_batch_size 4 x dp 1 x 8 accumulation steps
#   generation_batch_size = 32 (steps_per_generation 1) = 4 prompts x num_generations 8
#   rollout prompts per DP group = 4, a multiple of micro_batch_size 4; each GPU generates 16.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR#2000}
NPROC_PER_NODE=${NPROC_PER_NODE:-2} \
megatron rlhf --rlhf_type grpo \
    --model "$MODEL" \
    --dataset "$DATASET" \
    --train_type lora --lora_rank 16 --lora_alpha 32 --target_modules all-linear \
    --reward_funcs accuracy format \
    --tensor_model_parallel_size 2 \
    --num_generations 8 \
    --micro_batch_size 4 \
    --global_batch_size 32 \
    --max_completion_length 1024 \
    --max_length 2048 \
    --beta 0.04 \
    --lr 1e-4 \
    --train_iters 200 \
    --save output/grpo_lora --save_steps 50 \
    "$@"
