#!/usr/bin/env bash
# GRPO on one node with 8 GPUs: Qwen2.5-7B-Instruct with tensor parallelism 2 and sequence
# parallelism, the distributed optimizer, DAPO-style loss with clip-higher and dynamic sampling.
#
#   bash scripts/grpo/eight_gpus_tp2.sh [extra megatron rlhf flags]
#
# Batch arithmetic (completion level), world 8:
#   dp_size = 8 / (TP 2 x PP 1 x CP 1) = 4
#   global_batch_size 128 = micro_batch_size 4 x dp 4 x 8 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 128 x 4 = 512 completions
#   = 64 prompts x num_generations 8; each DP group gets 64 / 4 = 16 prompts (a multiple of
#   micro_batch_size 4), all 8 completions of a prompt on one DP group; every GPU generates
#   512 / 8 = 64 completions.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR}
NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
megatron rlhf --rlhf_type grpo \
    --model "$MODEL" \
    --dataset "$DATASET" \
    --reward_funcs accuracy format --reward_weights 1 0.1 \
    --tensor_model_parallel_size 2 \
    --sequence_parallel true \
    --use_distributed_optimizer true \
    --num_generations 8 \
    --micro_batch_size 4 \
    --global_batch_size 128 \
    --steps_per_generation 4 \
    --max_completion_length 2048 \
    --max_length 4096 \
    --loss_type dapo \
    --epsilon 0.2 --epsilon_high 0.28 \
    --dynamic_sample true --max_resample_times 3 \
    --overlong_filter true \
    --beta 0 \
    --lr 1e-6 --lr_warmup_iters 10 \
    --num_train_epochs 1 \
    --save output/grpo_8gpu_tp2 --save_steps 50 \
    "$@"
