#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/dense_colocate.sh as it is: GRPO of Qwen2.5-VL-3B-Instruct on
# CLEVR counting images (one node, 8 GPUs, vLLM colocate). Rows in ms-swift's multimodal format
# (docs/multimodal.md), e.g. one jsonl line per image:
#   {"images": ["/data/clevr/CLEVR_trainA_000001.png"],
#    "messages": [{"role": "user", "content": "<image>How many items are there in the image?
#                  Output the thinking process in <think> </think> and final answer (number)
#                  in <answer> </answer> tags."}],
#    "solution": "<answer> 3 </answer>"}
# (ms-swift's ClevrPreprocessor appends that instruction to the query of its hub dataset
# AI-ModelScope/clevr_cogen_a_train, the default here; we have no dataset preprocessors, so the
# hub rows' own columns must map to the format above, e.g. with --columns, and the instruction
# comes from --system only: their column names were not checked offline). `accuracy` reads the
# <answer>.
# MAX_PIXELS caps each image as in ms-swift's example (--max_pixels is the same as a flag); the
# vision tower and aligner stay frozen (--freeze_vit / --freeze_aligner default true), so weight
# syncs after the first send the language model only.
#
#   DATASET=/path/to/clevr.jsonl bash scripts/grpo/multimodal_colocate.sh [extra flags]
#   bash scripts/grpo/multimodal_colocate.sh --columns '{"problem": "query", "image": "images"}' 
#
# Batch arithmetic (completion level), world 8:
#   dp_size = 8 / (TP 1 x PP 1 x CP 1) = 8
#   global_batch_size 128 = micro_batch_size 4 x dp 8 x 4 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 512 completions = 64 prompts x 8 samples;
#   each DP group gets 8 prompts (a multiple of micro_batch_size 4).
# Not measured on a GPU yet (docs/multimodal.md).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}
DATASET=${DATASET:-AI-ModelScope/clevr_cogen_a_train#10000}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7} \
NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
MAX_PIXELS=${MAX_PIXELS:-602112} \
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
    --freeze_vit true \
    --freeze_aligner true \
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
    --padding_free true \
    --system "$HERE/prompt.txt" \
    --log_completions true \
    --report_to tensorboard \
    --train_iters 100 \
    --eval_steps 1000 \
    --save_steps 1000 \
    --output_dir megatron_output/multimodal_colocate \
    "$@"
