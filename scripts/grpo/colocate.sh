#!/usr/bin/env bash
# GRPO on one node with 8 GPUs, vLLM in colocate mode: every training process hosts a vLLM
# engine; consecutive pairs of processes form one vLLM TP=2 group (independent of Megatron's
# TP=2 here). While Megatron trains, vLLM sleeps (--sleep_level 1: KV cache freed, weights
# offloaded to host memory) and the training weights and optimizer state move to host memory
# while vLLM generates (--offload_model, --offload_optimizer). After every optimizer phase the
# new weights stream into vLLM in 512 MiB buckets (docs/rollout.md).
#
#   bash scripts/grpo/colocate.sh [extra megatron rlhf flags]
#   MODEL=/path/to/hf_model DATASET=/path/to/data.jsonl bash scripts/grpo/colocate.sh
#
# Batch arithmetic (completion level), world 8:
#   dp_size = 8 / (TP 2 x PP 1 x CP 1) = 4
#   global_batch_size 128 = micro_batch_size 4 x dp 4 x 8 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 128 x 4 = 512 completions
#   = 64 prompts x num_generations 8; each DP group gets 64 / 4 = 16 prompts (a multiple of
#   micro_batch_size 4); every GPU generates 512 / 8 = 64 completions, each vLLM TP group the
#   128 of its two processes (world 8 is divisible by vllm_tensor_parallel_size 2).
# Memory: vLLM may take 45% of each GPU (weights, KV cache, CUDA graphs) while generating.
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
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_tensor_parallel_size 2 \
    --vllm_gpu_memory_utilization 0.45 \
    --sleep_level 1 \
    --offload_model true \
    --offload_optimizer true \
    --beta 0.04 \
    --lr 1e-6 --lr_warmup_iters 10 \
    --num_train_epochs 1 \
    --save output/grpo_colocate --save_interval 50 \
    "$@"
