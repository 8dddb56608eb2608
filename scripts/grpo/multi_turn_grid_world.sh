#!/usr/bin/env bash
# Multi-turn GRPO with a gym environment, as ms-swift's
# examples/megatron/grpo/multi_turn/frozen_lake.sh: the built-in grid_world (a FrozenLake-like
# 4x4 lake, docs/multi_turn.md) driven by gym_scheduler, the environment's total reward as the
# only reward (--use_gym_env, implied by --gym_env), vLLM in colocate mode, LoRA. ms-swift's
# example trains Qwen3.5-2B (MODEL=Qwen/Qwen3.5-2B here); its plugin's frozen_lake works here too:
# --external_plugins frozen_lake_plugin.py --gym_env frozen_lake.
#
#   bash scripts/grpo/multi_turn_grid_world.sh [extra megatron rlhf flags]
#
# The dataset only seeds the maps: one row per episode, {"messages": [...placeholder...],
# "env_config": {"seed": N}}; the environment writes the prompt.
# Batch arithmetic (completion level), world 8: dp_size 8;
#   global_batch_size 64 = micro_batch_size 1 x dp 8 x 8 accumulation steps
#   steps_per_generation 4 -> generation_batch_size 256 = 32 prompts x num_generations 8
# Budget: each model turn up to 512 tokens (--completion_length_limit_scope per_round), the
# whole conversation within --max_length 6120; vllm_max_model_len covers it.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-1.7B}
DATA=${DATA:-${WORK:-megatron_output}/grid_world.jsonl}
mkdir -p "$(dirname "$DATA")"
python - "$DATA" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for seed in range(1024):
        f.write(json.dumps({"messages": [{"role": "user", "content": "<placeholder>"}],
                            "env_config": {"seed": seed}}) + "\n")
PY
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7} \
NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
megatron rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --enable_thinking false \
    --dataset "$DATA" \
    --train_iters 120 \
    --global_batch_size 64 \
    --micro_batch_size 1 \
    --steps_per_generation 4 \
    --num_generations 8 \
    --multi_turn_scheduler gym_scheduler \
    --gym_env grid_world \
    --max_turns 10 \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.5 \
    --vllm_max_model_len 6632 \
    --max_length 6120 \
    --max_completion_length 512 \
    --tuner_type lora \
    --lr 5e-5 \
    --bf16 true \
    --beta 0.001 \
    --epsilon 0.2 \
    --overlong_filter true \
    --loss_type grpo \
    --sleep_level 1 \
    --offload_model true \
    --offload_optimizer true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --temperature 1.0 \
    --top_k 80 \
    --padding_free true \
    --log_completions true \
    --report_to tensorboard \
    --save_steps 1000 \
    --output_dir megatron_output/grid_world \
    "$@"
