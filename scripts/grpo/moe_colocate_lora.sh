#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/moe_colocate_lora.sh: LoRA GRPO of Qwen3-30B-A3B on one node
# with 8 GPUs, TP 2 x EP 4 x PP 2 x CP 2, sequence parallelism (a MoE model with TP needs it),
# vLLM in colocate mode with TP 4. Context parallelism splits each sequence over 2 GPUs
# (megatron's load-balanced layout; docs/rlhf.md, Parallelism).
#
#   bash scripts/grpo/moe_colocate_lora.sh [extra megatron rlhf flags]
#
# Batch arithmetic (completion level), world 8:
#   dp_size = 8 / (TP 2 x PP 2 x CP 2) = 1
#   global_batch_size 64 = micro_batch_size 2 x dp 1 x 32 accumulation steps
#   steps_per_generation 2 -> generation_batch_size = 64 x 2 = 128 completions
#   = 16 prompts x num_generations 8; the one DP group gets all 16 prompts (a multiple of
#   micro_batch_size 2); every vLLM TP-4 group generates the 64 completions of its 4 processes.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B-Instruct-2507}
DATASET=${DATASET:-open-r1/DAPO-Math-17k-Processed}
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7} \
NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
megatron rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --save_safetensors true \
    --merge_lora false \
    --context_parallel_size 2 \
    --tensor_model_parallel_size 2 \
    --expert_model_parallel_size 4 \
    --pipeline_model_parallel_size 2 \
    --dataset "$DATASET" \
    --num_train_epochs 1 \
    --global_batch_size 64 \
    --micro_batch_size 2 \
    --steps_per_generation 2 \
    --num_generations 8 \
    --reward_funcs accuracy format \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.3 \
    --vllm_tensor_parallel_size 4 \
    --vllm_max_model_len 16384 \
    --max_length 8192 \
    --max_completion_length 8192 \
    --tuner_type lora \
    --lr 5e-5 \
    --bf16 true \
    --beta 0.00 \
    --importance_sampling_level sequence \
    --epsilon 3e-4 \
    --epsilon_high 4e-4 \
    --dynamic_sample false \
    --overlong_filter true \
    --loss_type grpo \
    --sleep_level 1 \
    --offload_model true \
    --offload_optimizer true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --temperature 1.0 \
    --sequence_parallel true \
    --log_completions true \
    --report_to tensorboard \
    --output_dir megatron_output/moe_colocate_lora \
    "$@"
