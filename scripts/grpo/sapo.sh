#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/sapo.sh, for a text model: SAPO (soft adaptive policy
# optimization, arXiv:2511.20347) replaces GRPO's hard clip with a sigmoid gate on the importance
# ratio, temperature --tau_pos for positive and --tau_neg for negative advantages (docs/rlhf.md).
# vLLM in colocate mode on one node of 8 GPUs. The flags are ms-swift's; its version trains
# Qwen2.5-VL-3B on CLEVR with its plugin's rewards (multimodal_colocate.sh shows that setup),
# so the rewards here are accuracy and format.
#
#   bash scripts/grpo/sapo.sh [extra megatron rlhf flags]
#   MODEL=/path/to/hf_model DATASET=/path/to/data.jsonl bash scripts/grpo/sapo.sh
#
# Batch arithmetic (completion level), world 8:
#   dp_size = 8 / (TP 1 x PP 1 x CP 1) = 8
#   global_batch_size 128 = micro_batch_size 2 x dp 8 x 8 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 512 completions = 64 prompts x 8;
#   each DP group gets 64 / 8 = 8 prompts (a multiple of micro_batch_size 2).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR#10000}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7} \
NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
megatron rlhf \
    --rlhf_type grpo \
    --loss_type sapo \
    --tau_pos 1 \
    --tau_neg 1.05 \
    --model "$MODEL" \
    --context_parallel_size 1 \
    --tensor_model_parallel_size 1 \
    --pipeline_model_parallel_size 1 \
    --dataset "$DATASET" \
    --save_safetensors true \
    --reward_funcs accuracy format \
    --dynamic_sample false \
    --steps_per_generation 4 \
    --micro_batch_size 2 \
    --global_batch_size 128 \
    --num_generations 8 \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.7 \
    --vllm_max_model_len 8192 \
    --max_length 4096 \
    --max_completion_length 4096 \
    --tuner_type full \
    --bf16 true \
    --importance_sampling_level token \
    --epsilon 0.2 \
    --epsilon_high 0.2 \
    --overlong_filter true \
    --num_train_epochs 1 \
    --eval_steps 1000 \
    --save_steps 1000 \
    --sleep_level 2 \
    --offload_model true \
    --offload_optimizer true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --lr 1e-6 \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --attention_backend flash \
    --temperature 1.0 \
    --system "$HERE/prompt.txt" \
    --beta 0.001 \
    --padding_free true \
    --report_to tensorboard \
    --output_dir megatron_output/sapo \
    "$@"
