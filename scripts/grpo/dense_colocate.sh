#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/dense_colocate.sh, for a text model: GRPO on one node with 8
# GPUs, vLLM in colocate mode (a vLLM engine in every training process, asleep while Megatron
# trains: --sleep_level 1 frees its KV cache and offloads its weights to host memory; the
# training weights and optimizer state move to host memory while vLLM generates). The flags are
# ms-swift's; ms-swift's version trains Qwen2.5-VL-3B on CLEVR: multimodal_colocate.sh.
#
#   bash scripts/grpo/dense_colocate.sh [extra megatron rlhf flags]
#   MODEL=/path/to/hf_model DATASET=/path/to/data.jsonl bash scripts/grpo/dense_colocate.sh
#
# Batch arithmetic (completion level), world 8:
#   dp_size = 8 / (TP 1 x PP 1 x CP 1) = 8
#   global_batch_size 128 = micro_batch_size 4 x dp 8 x 4 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 128 x 4 = 512 completions
#   = 64 prompts x num_generations 8; each DP group gets 64 / 8 = 8 prompts (a multiple of
#   micro_batch_size 4); every GPU generates 512 / 8 = 64 completions.
# --sleep_level 2 (ms-swift's example) becomes 1 on CUDA with a notice (docs/rollout.md).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR#10000}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7} \
NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
megatron rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --save_safetensors true \
    --context_parallel_size 1 \
    --tensor_model_parallel_size 1 \
    --pipeline_model_parallel_size 1 \
    --dataset "$DATASET" \
    --num_train_epochs 1 \
    --global_batch_size 128 \
    --micro_batch_size 4 \
    --steps_per_generation 4 \
    --num_generations 8 \
    --reward_funcs accuracy format \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.7 \
    --vllm_max_model_len 10240 \
    --max_length 8192 \
    --max_completion_length 2048 \
    --tuner_type full \
    --lr 1e-6 \
    --bf16 true \
    --beta 0.001 \
    --importance_sampling_level token \
    --epsilon 0.2 \
    --epsilon_high 0.2 \
    --dynamic_sample false \
    --overlong_filter true \
    --loss_type grpo \
    --sleep_level 1 \
    --offload_model true \
    --offload_bridge false \
    --offload_optimizer true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --temperature 1.0 \
    --system "$HERE/prompt.txt" \
    --log_completions true \
    --report_to tensorboard \
    --train_iters 100 \
    --eval_steps 1000 \
    --save_steps 1000 \
    --output_dir megatron_output/dense_colocate \
    "$@"
