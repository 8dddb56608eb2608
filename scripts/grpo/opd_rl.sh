#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/opd_rl.sh: on-policy distillation as RL (OPD-RL). A larger
# teacher of the same family scores every token the student samples, and the advantage of token
# t becomes A + teacher_kl_coef x (teacher logprob - student logprob) (docs/rlhf.md). One
# completion per prompt (--num_generations 1), LoRA on TP 2, vLLM colocate. ms-swift's script
# distils Qwen3.5-9B into Qwen3.5-2B; here Qwen3-8B into Qwen3-1.7B by default
# (MODEL=Qwen/Qwen3.5-2B TEACHER=Qwen/Qwen3.5-9B for ms-swift's pair).
# As in ms-swift's script there is no reward function: the teacher is the only signal.
#
#   bash scripts/grpo/opd_rl.sh [extra megatron rlhf flags]
#   MODEL=... TEACHER=... DATASET=... bash scripts/grpo/opd_rl.sh
#
# Batch arithmetic (completion level), world 2:
#   dp_size = 2 / (TP 2 x PP 1 x CP 1) = 1
#   global_batch_size 16 = micro_batch_size 2 x dp 1 x 8 accumulation steps
#   steps_per_generation 2 -> generation_batch_size = 32 completions = 32 prompts x 1;
#   the DP group gets 32 prompts (a multiple of micro_batch_size 2).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-1.7B}
TEACHER=${TEACHER:-Qwen/Qwen3-8B}
DATASET=${DATASET:-modelscope/gsm8k}
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} \
NPROC_PER_NODE=${NPROC_PER_NODE:-2} \
megatron rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --teacher_model "$TEACHER" \
    --enable_thinking false \
    --save_safetensors true \
    --expert_model_parallel_size 1 \
    --tensor_model_parallel_size 2 \
    --pipeline_model_parallel_size 1 \
    --sequence_parallel true \
    --system "You are a helpful math assistant. Solve the problem step by step and put your final answer within \\boxed{}." \
    --dataset "$DATASET" \
    --num_train_epochs 1 \
    --global_batch_size 16 \
    --micro_batch_size 2 \
    --steps_per_generation 2 \
    --num_generations 1 \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.6 \
    --vllm_tensor_parallel_size 1 \
    --vllm_max_model_len 12288 \
    --sleep_level 1 \
    --max_length 4096 \
    --max_completion_length 2048 \
    --tuner_type lora \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --lr 3e-5 \
    --bf16 true \
    --beta 0 \
    --epsilon 0.2 \
    --epsilon_high 0.2 \
    --loss_type grpo \
    --offload_model true \
    --offload_bridge false \
    --offload_optimizer true \
    --log_rollout_offpolicy_metrics true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --attention_backend flash \
    --temperature 1 \
    --padding_free false \
    --log_completions true \
    --report_to tensorboard \
    --train_iters 1000 \
    --eval_steps 1000 \
    --save_steps 100 \
    --top_k 0 \
    --top_p 1 \
    --output_dir megatron_output/opd_rl \
    "$@"
