#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/real.sh: REAL (rewards as labels, arXiv:2602.05630) trains
# an in-group classifier of the completions' mean log ratios instead of weighting tokens by
# advantages (docs/rlhf.md). Each micro-batch must hold whole groups: micro_batch_size 8 is a
# multiple of num_generations 8 (checked at start). Rewards are not scaled (--scale_rewards none,
# REAL's default). `megatron rollout` (ms-swift: `swift rollout`) serves vLLM on GPU 2, the
# trainer runs on GPUs 0-1. The flags are ms-swift's.
#
#   bash scripts/grpo/real.sh [extra megatron rlhf flags]
#   MODEL=/path/to/hf_model DATASET=/path/to/data.jsonl PORT=8001 bash scripts/grpo/real.sh
#
# Batch arithmetic (completion level), trainer world 2:
#   dp_size = 2 / (TP 1 x PP 1 x CP 1) = 2
#   global_batch_size 128 = micro_batch_size 8 x dp 2 x 8 accumulation steps
#   generation_batch_size = 128 (steps_per_generation 1) = 16 prompts x num_generations 8;
#   each DP group gets 8 prompts (a multiple of micro_batch_size 8).
# With --dry_run true only the trainer's plan is printed (no server is started).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATASET=${DATASET:-AI-MO/NuminaMath-TIR#4000}
PORT=${PORT:-8000}

case " $* " in
    *" --dry_run true "*) DRY_RUN=1 ;;
    *) DRY_RUN=0 ;;
esac

if [ "$DRY_RUN" = 0 ]; then
    CUDA_VISIBLE_DEVICES=2 megatron rollout --model "$MODEL" --port "$PORT" &
    SERVER_PID=$!
    trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
    echo "waiting for the rollout server on port $PORT ..."
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "the rollout server exited"; exit 1; }
        sleep 5
    done
fi

CUDA_VISIBLE_DEVICES=0,1 \
NPROC_PER_NODE=2 \
megatron rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --save_safetensors true \
    --context_parallel_size 1 \
    --tensor_model_parallel_size 1 \
    --pipeline_model_parallel_size 1 \
    --dataset "$DATASET" \
    --num_train_epochs 1 \
    --micro_batch_size 8 \
    --global_batch_size 128 \
    --num_generations 8 \
    --reward_funcs accuracy \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host 127.0.0.1 \
    --vllm_server_port "$PORT" \
    --max_completion_length 2048 \
    --tuner_type full \
    --gradient_accumulation_fusion false \
    --lr 2e-6 \
    --bf16 true \
    --beta 0.001 \
    --dynamic_sample false \
    --loss_type real \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --dataset_num_proc 8 \
    --padding_free true \
    --attention_backend flash \
    --no_save_optim \
    --no_save_rng \
    --temperature 0.6 \
    --system "You are a helpful math assistant. Solve the problem step by step and put your final answer within \\boxed{}." \
    --log_completions true \
    --eval_steps 100 \
    --save_steps 100 \
    --output_dir megatron_output/real \
    "$@"
