#!/usr/bin/env bash
# GRPO on one node with 8 GPUs, vLLM in server mode: `megatron rollout` serves two vLLM
# replicas on GPUs 0-1 (data parallel 2, TP 1), the trainer runs on GPUs 2-7 and talks to it
# over HTTP; after every optimizer phase its rank 0 broadcasts the new weights to the server's
# workers over NCCL (docs/rollout.md).
#
#   bash scripts/grpo/server.sh [extra megatron rlhf flags]
#   MODEL=/path/to/hf_model DATASET=/path/to/data.jsonl PORT=8001 bash scripts/grpo/server.sh
#
# Batch arithmetic (completion level), trainer world 6:
#   dp_size = 6 / (TP 2 x PP 1 x CP 1) = 3
#   global_batch_size 96 = micro_batch_size 4 x dp 3 x 8 accumulation steps
#   steps_per_generation 4 -> generation_batch_size = 96 x 4 = 384 completions
#   = 48 prompts x num_generations 8; each DP group gets 48 / 3 = 16 prompts (a multiple of
#   micro_batch_size 4), 384 / 6 = 64 completions per training process; rank 0 sends all 384
#   to the server at once, which splits them over its 2 replicas.
# With --dry_run true only the trainer's plan is printed (no server is started).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR}
PORT=${PORT:-8000}

case " $* " in
    *" --dry_run true "*) DRY_RUN=1 ;;
    *) DRY_RUN=0 ;;
esac

if [ "$DRY_RUN" = 0 ]; then
    CUDA_VISIBLE_DEVICES=0,1 megatron rollout \
        --model "$MODEL" \
        --vllm_tensor_parallel_size 1 \
        --vllm_data_parallel_size 2 \
        --vllm_max_model_len 4096 \
        --host 127.0.0.1 --port "$PORT" &
    SERVER_PID=$!
    trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
    echo "waiting for the rollout server on port $PORT ..."
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "the rollout server exited"; exit 1; }
        sleep 5
    done
fi

CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 \
NPROC_PER_NODE=6 \
megatron rlhf --rlhf_type grpo \
    --model "$MODEL" \
    --dataset "$DATASET" \
    --reward_funcs accuracy format --reward_weights 1 0.1 \
    --tensor_model_parallel_size 2 \
    --sequence_parallel true \
    --use_distributed_optimizer true \
    --num_generations 8 \
    --micro_batch_size 4 \
    --global_batch_size 96 \
    --steps_per_generation 4 \
    --max_completion_length 2048 \
    --max_length 4096 \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host 127.0.0.1 \
    --vllm_server_port "$PORT" \
    --vllm_server_timeout 600 \
    --beta 0.04 \
    --lr 1e-6 --lr_warmup_iters 10 \
    --num_train_epochs 1 \
    --save output/grpo_server --save_interval 50 \
    "$@"
