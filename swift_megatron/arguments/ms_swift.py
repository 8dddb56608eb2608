"""What we know about flag names that are not ours, so an unknown flag gets a useful answer.

- `NOT_SUPPORTED`: flags ms-swift's Megatron GRPO accepts that swift-megatron does not (yet),
  each with the reason, or the feature (and its tracking issue) that will add it.
- `HINTS`: names users bring from TRL, transformers or Megatron-LM, and what to use instead.
- `SCHEDULERS`: ms-swift's built-in multi-turn scheduler names that are not built in here.

Used by arguments/parser.py when it reports unknown flags (all at once, each with the table's
answer, else the closest known flag when one is really close). Nothing here is accepted as a
flag: a name in these tables still fails the parse, with the reason.
"""
from typing import Dict, Optional

_MULTIMODAL = ("not supported: of the vision-language options, GRPO with images on Qwen2.5-VL, "
               "Qwen3-VL and Qwen3.5, --max_pixels, --freeze_vit/--freeze_aligner/--freeze_llm, "
               "--vit_lr/--aligner_lr and --train_type lora_llm are (docs/multimodal.md)")
_SERVER_SCHEDULER = ("not needed: every dataset column reaches the multi-turn scheduler, "
                     "whether the trainer runs it (--multi_turn_scheduler) or the rollout server "
                     "(megatron rollout --multi_turn_scheduler) (docs/multi_turn.md)")
_TE = "needs Transformer Engine, which swift-megatron does not use"

NOT_SUPPORTED: Dict[str, str] = {
    # multimodal
    **{name: _MULTIMODAL for name in (
        "vit_gradient_checkpointing", "vit_attn_impl", "vllm_limit_mm_per_prompt",
        "vllm_mm_processor_cache_gb", "language_model_only")},
    # on-policy distillation
    "teacher_model_server": "a teacher served over HTTP is not supported: load it in the trainer "
                            "with --teacher_model (an HF directory or hub id; "
                            "--offload_teacher_model keeps it in host memory between passes)",
    "teacher_tag_key": "multi-teacher routing needs --teacher_model_server, which is not "
                       "supported: one --teacher_model scores every completion",
    # multi-turn
    "vllm_server_pass_dataset": _SERVER_SCHEDULER,
    "context_manager": "removed in ms-swift too: change the conversation between turns in a "
                       "--multi_turn_scheduler (docs/multi_turn.md)",
    # parallelism
    "cp_comm_type": "context parallelism has one implementation, all-gather of keys and values "
                    "in our SDPA attention (Transformer Engine's p2p / a2a variants are not "
                    "used): drop the flag",
    "microbatch_group_size_per_vp_stage": "the interleaved pipeline runs micro-batches in "
                                          "groups of --pipeline_model_parallel_size (megatron's "
                                          "default): drop the flag",
    "pipeline_model_parallel_layout": "layers split evenly: PP x "
                                      "--virtual_pipeline_model_parallel_size chunks of equal "
                                      "size; an uneven layout is not supported",
    # not planned
    "use_ray": "swift-megatron launches with torchrun, not Ray: pass the flags of the `train:` and "
               "`rollout:` sections as ordinary flags, NPROC_PER_NODE for `gpus`, and "
               "--vllm_mode colocate (colocate_groups) or server (a `megatron rollout` server)",
    "colocate_groups": "a Ray launcher setting (see use_ray)",
    "bridge_backend": "swift-megatron has its own bridge (swift_megatron/bridge)",
    "optimizer": "only Adam(W) is supported",
    "use_megatron_fsdp": "Megatron-FSDP is not supported: use --use_distributed_optimizer",
    "fp8_format": "FP8 training " + _TE, "fp8_recipe": "FP8 training " + _TE,
    "fp4_format": "FP4 training " + _TE,
    "tp_comm_overlap": "tensor-parallel communication overlap " + _TE,
    "packing": "not needed: each micro-batch's sequences are packed already (--padding_free "
               "true, the default)",
    "streaming": "streaming datasets are not supported: datasets are loaded into memory",
    "save_strategy": "checkpoints are saved every --save_steps optimizer steps",
    "metric_for_best_model": "--save_total_limit keeps the checkpoint with the best reward/mean",
    "use_vllm_lora": "vLLM LoRA adapters are not supported: weights are synced merged",
    "vllm_enable_lora": "vLLM LoRA adapters are not supported: weights are synced merged",
    "template": "prompts use the tokenizer's chat template",
    "custom_register_path": "custom model registration is not supported",
}

HINTS: Dict[str, str] = {
    "per_device_train_batch_size": "--micro_batch_size (completions per forward pass)",
    "gradient_accumulation_steps": "--global_batch_size (= micro_batch_size x dp_size x "
                                   "accumulation steps)",
    "learning_rate": "--lr",
    "max_steps": "--train_iters",
    "warmup_ratio": "--lr_warmup_fraction",
    "warmup_steps": "--lr_warmup_iters",
    "max_grad_norm": "--clip_grad",
    "lr_scheduler_type": "--lr_decay_style",
    "max_prompt_length": "--max_length (prompt + completion) with --max_completion_length",
    "model_name_or_path": "--model",
    "model_id": "--model",
    "dataset_name": "--dataset",
    "logging_dir": "--tensorboard_dir",
    "run_name": "--wandb_exp_name",
    "lora_r": "--lora_rank",
    "lora_target_modules": "--target_modules",
    "deepspeed": "Megatron parallelism: --tensor_model_parallel_size, "
                 "--pipeline_model_parallel_size, --use_distributed_optimizer",
    "nproc_per_node": "the environment variable NPROC_PER_NODE",
    "nnodes": "the environment variable NNODES",
    "tp": "--tensor_model_parallel_size", "tp_size": "--tensor_model_parallel_size",
    "pp": "--pipeline_model_parallel_size", "pp_size": "--pipeline_model_parallel_size",
    "ep": "--expert_model_parallel_size", "ep_size": "--expert_model_parallel_size",
    "vllm_tp": "--vllm_tensor_parallel_size",
    "seq_length": "--max_length",
    "kl_coef": "--beta",
    "num_completions": "--num_generations",
    "group_size": "--num_generations",
    "max_new_tokens": "--max_completion_length",
    "eval_strategy": "--eval_steps",
    "save_dir": "--save (or --output_dir)",
}


_WRITE_A_SCHEDULER = ("is not built in here: write it as a --multi_turn_scheduler plugin (a "
                      "few lines: docs/multi_turn.md; ms-swift's scheduler classes load "
                      "unchanged) or use a built-in one (calculator, gym_scheduler)")
# ms-swift's built-in multi-turn schedulers that are not ours, with the reason and the way out
SCHEDULERS: Dict[str, str] = {
    "base_scheduler": "ms-swift's single-turn base class: drop --multi_turn_scheduler (one "
                      "turn is the default)",
    "math_tip_trick": "ms-swift's math tip (re-ask once with a 'recheck' prompt after a wrong "
                      "answer) " + _WRITE_A_SCHEDULER,
    "math_tip_trick_multi_turn": "ms-swift's multi-turn math tip " + _WRITE_A_SCHEDULER,
    "thinking_tips_scheduler": "ms-swift's thinking-model tips " + _WRITE_A_SCHEDULER,
}


def explain(name: str) -> Optional[str]:
    """The table's answer for an unknown flag name (without dashes), or None."""
    if name in NOT_SUPPORTED:
        return f"ms-swift flag not supported here: {NOT_SUPPORTED[name]}"
    if name in HINTS:
        return f"use {HINTS[name]}"
    return None
