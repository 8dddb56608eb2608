#!/usr/bin/env bash
# Multi-turn GRPO with a tool: the built-in calculator scheduler (docs/multi_turn.md). When a
# model turn holds <calculator>EXPRESSION</calculator>, the result comes back as a tool message
# and the model continues; a turn without a call ends the episode, and its last answer is scored
# (accuracy, format). The tool's tokens get no loss weight. vLLM colocate, 8 GPUs.
#
#   bash scripts/grpo/multi_turn_calculator.sh [extra megatron rlhf flags]
#
# Batch arithmetic as scripts/grpo/dense_colocate.sh (dp 8, global_batch_size 128 = 4 x 8 x 4,
# 512 completions = 64 prompts x 8 per rollout batch).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR#10000}
SYSTEM="You are a helpful math assistant with a calculator. To compute, write \
<calculator>expression</calculator> (numbers, + - * / ** and parentheses) and stop; the result \
comes back as <result>value</result>. Put your final answer within \\boxed{}."
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7} \
NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
megatron rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --dataset "$DATASET" \
    --system "$SYSTEM" \
    --multi_turn_scheduler calculator \
    --max_turns 4 \
    --completion_length_limit_scope per_round \
    --reward_funcs accuracy format \
    --num_train_epochs 1 \
    --global_batch_size 128 \
    --micro_batch_size 4 \
    --steps_per_generation 4 \
    --num_generations 8 \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.6 \
    --vllm_max_model_len 8192 \
    --max_length 8192 \
    --max_completion_length 1024 \
    --lr 1e-6 \
    --bf16 true \
    --beta 0.001 \
    --overlong_filter true \
    --sleep_level 1 \
    --offload_model true \
    --offload_optimizer true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --temperature 1.0 \
    --log_completions true \
    --report_to tensorboard \
    --train_iters 100 \
    --save_steps 1000 \
    --output_dir megatron_output/multi_turn_calculator \
    "$@"
