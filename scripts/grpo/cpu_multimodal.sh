#!/usr/bin/env bash
# GRPO with images on a CPU: a tiny random Qwen2.5-VL and the colour task built locally (a red or
# blue square per image, `solution` the colour; nothing is downloaded), the embedded transformers
# rollout engine given each prompt's pixels, and the colour_parity reward of the demo plugin.
# --check_weight_sync compares the engine's and the trainer's logprobs on image prompts after
# every sync (printed as sync/logprob_abs_diff_mean, ~1e-7 in float32). A smoke run: the tiny
# random model does not learn this task (squares) in a few steps; the image-filling variant is learnt
# in about ten (docs/multimodal.md). About 20 s on 2 cores.
#
#   bash scripts/grpo/cpu_multimodal.sh [extra megatron rlhf flags]
#
# Batch arithmetic (completion level), one process: dp_size = 1
#   global_batch_size 32 = micro_batch_size 4 x dp 1 x 8 accumulation steps
#   generation_batch_size = 32 completions = 4 prompts x 8 samples
set -euo pipefail
WORK=${WORK:-demo_output}
python scripts/make_tiny_models.py --output_dir "$WORK" --families qwen2_5_vl --dataset_rows 8 \
    --image_dataset_rows 64
megatron rlhf --rlhf_type grpo \
    --model "$WORK/qwen2_5_vl" \
    --dataset "$WORK/colours.jsonl" \
    --external_plugins swift_megatron/demo/rewards.py \
    --reward_funcs colour_parity \
    --num_generations 8 \
    --micro_batch_size 4 \
    --global_batch_size 32 \
    --max_completion_length 4 \
    --train_iters 3 \
    --beta 0.1 \
    --lr 1e-3 \
    --check_weight_sync true \
    --device cpu \
    --output_dir "$WORK/grpo_multimodal" \
    "$@"
