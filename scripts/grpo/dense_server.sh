#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/dense_server.sh, for a text model: `megatron rollout` (ms-swift:
# `swift rollout`) serves two vLLM replicas on GPUs 6-7, the trainer runs on GPUs 0-5 and talks to
# it over HTTP; after every optimizer phase its rank 0 broadcasts the new weights to the server's
# workers over NCCL (docs/rollout.md). The flags are ms-swift's.
#
#   bash scripts/grpo/dense_server.sh [extra megatron rlhf flags]
#   MODEL=/path/to/hf_model DATASET=/path/to/data.jsonl PORT=8001 bash scripts/grpo/dense_server.sh
#
# Batch arithmetic (completion level), trainer world 6:
#   dp_size = 6 / (TP 1 x PP 1 x CP 1) = 6
#   global_batch_size 96 = micro_batch_size 4 x dp 6 x 4 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 96 x 4 = 384 completions
#   = 48 prompts x num_generations 8; each DP group gets 48 / 6 = 8 prompts (a multiple of
#   micro_batch_size 4); rank 0 sends all 384 requests, the server splits them over its replicas.
# With --dry_run true only the trainer's plan is printed (no server is started).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR#10000}
PORT=${PORT:-8000}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

case " $* " in
    *" --dry_run true "*) DRY_RUN=1 ;;
    *) DRY_RUN=0 ;;
esac

if [ "$DRY_RUN" = 0 ]; then
    CUDA_VISIBLE_DEVICES=6,7 megatron rollout \
        --model "$MODEL" \
        --vllm_data_parallel_size 2 \
        --vllm_max_model_len 10240 \
        --port "$PORT" &
    SERVER_PID=$!
    trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
    echo "waiting for the rollout server on port $PORT ..."
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "the rollout server exited"; exit 1; }
        sleep 5
    done
fi

CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 \
NPROC_PER_NODE=6 \
megatron rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --save_safetensors true \
    --context_parallel_size 1 \
    --tensor_model_parallel_size 1 \
    --pipeline_model_parallel_size 1 \
    --dataset "$DATASET" \
    --num_train_epochs 1 \
    --global_batch_size 96 \
    --micro_batch_size 4 \
    --steps_per_generation 4 \
    --num_generations 8 \
    --reward_funcs accuracy format \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host 127.0.0.1 \
    --vllm_server_port "$PORT" \
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
    --output_dir megatron_output/dense_server \
    "$@"
