"""What we know about flag names that are not ours, so an unknown flag gets a useful answer.

- `NOT_SUPPORTED`: flags ms-swift's Megatron GRPO accepts that swift-megatron does not (yet),
  each with the reason, or the feature (and its tracking issue) that will add it; names of one
  family share their reason (one constant per family).
- `FAMILIES`: name patterns (`muon_*`, `fp8_*`, ...) whose every name gets its family's reason.
- `HINTS`: names users bring from TRL, transformers or Megatron-LM, and what to use instead.
- `SCHEDULERS`: ms-swift's built-in multi-turn scheduler names that are not built in here.

Used by arguments/parser.py when it reports unknown flags (all at once, each with the table's
answer, else the closest known flag when one is really close). Nothing here is accepted as a
flag: a name in these tables still fails the parse, with the reason.
"""
import re
from typing import Dict, Optional, Tuple

_MULTIMODAL = ("not supported: of the vision-language options, GRPO with images on Qwen2.5-VL, "
               "Qwen3-VL and Qwen3.5, --max_pixels, --freeze_vit/--freeze_aligner/--freeze_llm, "
               "--vit_lr/--aligner_lr and --train_type lora_llm are (docs/multimodal.md)")
_SERVER_SCHEDULER = ("not needed: every dataset column reaches the multi-turn scheduler, "
                     "whether the trainer runs it (--multi_turn_scheduler) or the rollout server "
                     "(megatron rollout --multi_turn_scheduler) (docs/multi_turn.md)")
_TE = "needs Transformer Engine, which swift-megatron does not use"
_OPTIMIZER = ("only Adam(W) is supported (megatron-core's Adam: --adam_beta1, --adam_beta2, "
              "--adam_eps, --weight_decay); SGD and Muon are not")
_FSDP = "Megatron-FSDP is not supported: use --use_distributed_optimizer (the default)"
_STREAMING = "streaming datasets are not supported: datasets are loaded into memory"
_BEST = "--save_total_limit keeps the checkpoint with the best reward/mean"
_TEMPLATE = ("prompts use the tokenizer's own chat template (with --system and "
             "--enable_thinking); ms-swift's template options are not available")
_FP8 = "FP8 and FP4 training " + _TE
_RAY = "a Ray launcher setting (see --use_ray)"
_ARGS_JSON = ("flags are not read back from a checkpoint's args.json: pass them again (a "
              "--config file keeps them)")
_DIST_CKPT = ("checkpoints are written synchronously in megatron's torch_dist format, the "
              "optimizer state dp-reshardable (it resumes in the TP/PP/EP layout it was saved "
              "with, at any DP size): drop the flag")
_PACKING = ("not needed: each micro-batch's sequences are packed already (--padding_free "
            "true, the default)")
_LOAD_DATA = ("datasets are read and tokenized in memory at every start: pass the source "
              "files or hub ids to --dataset / --val_dataset")
_COLUMNS = ("every dataset column reaches the reward functions and multi-turn schedulers; "
            "rename columns with --columns")
_LOSS_SCALE = ("SFT's per-token loss weights: GRPO weighs completion tokens by their "
               "advantages (--loss_type)")
_FROM_CONFIG = ("megatron builds the model from config.json and loads its weights; "
                "transformers' loading options do not apply")
_INIT = ("weights always come from --model or --mcore_model (a run never starts from random "
         "weights)")
_OTHER_FAMILIES = ("an option of model families swift-megatron does not support (DeepSeek's "
                   "sparse attention, DeepSeek-V4's compressed attention and mHC)")
_MTP = ("multi-token prediction is not supported: GRPO trains the main model (a checkpoint's "
        "MTP layers are not loaded)")
_ROPE = ("RoPE scaling comes from the model's config.json (its rope_scaling entry; YaRN is "
         "supported): edit it there. vLLM's context length is --vllm_max_model_len")
_PP_SPLIT = ("set the uneven split explicitly with --decoder_first_pipeline_num_layers / "
             "--decoder_last_pipeline_num_layers (fewer layers on the stage that holds the "
             "embedding or the output layer)")
_P2P = ("the pipeline's point-to-point transfers are set per schedule by swift-megatron "
        "(batched, except where that crosses the interleaved schedule's messages): drop the flag")
_OVERLAP_TUNING = ("not supported: --overlap_grad_reduce / --overlap_param_gather start each "
                   "bucket's reduction as its gradients are ready, megatron's default: drop the "
                   "flag")
_LORA_SHAPE = ("adapters have no bias and train in the model's dtype (ms-swift's defaults, "
               "lora_bias none and lora_dtype none): drop the flag")

def _family(reason: str, *names: str) -> Dict[str, str]:
    """{name: reason} for each name of one family."""
    return {name: reason for name in names}


_FAMILY_NAMES: Dict[str, str] = {
    **_family(_OPTIMIZER, "sgd_momentum"),
    **_family(_FSDP, "data_parallel_sharding_strategy"),
    **_family(_STREAMING, "shuffle_buffer_size"),
    **_family(_BEST, "greater_is_better"),
    **_family(_TEMPLATE, "template_backend", "use_chat_template", "padding_side",
              "response_prefix", "preserve_thinking", "add_non_thinking_prefix",
              "disable_ignore_empty_think", "norm_bbox", "new_special_tokens"),
    **_family(_RAY, "ray_exp_name", "device_groups", "skip_megatron_init"),
    **_family(_ARGS_JSON, "load_args", "load_data_args"),
    **_family(_DIST_CKPT, "async_save", "use_persistent_ckpt_worker",
              "dist_ckpt_save_pre_mcore_014", "dist_ckpt_optim_fully_reshardable",
              "distrib_optim_fully_reshardable_mem_efficient"),
    **_family(_PACKING, "sequence_packing_scheduler", "mlp_padding_free"),
    **_family(_LOAD_DATA, "cached_dataset", "cached_val_dataset", "lazy_tokenize",
              "download_mode", "custom_dataset_info"),
    **_family(_COLUMNS, "remove_unused_columns", "disable_auto_column_mapping"),
    **_family(_LOSS_SCALE, "loss_scale", "is_binary_loss_scale"),
    **_family(_FROM_CONFIG, "device_map", "max_memory", "model_kwargs", "local_repo_path",
              "experts_impl"),
    **_family(_INIT, "perform_initialization", "init_strategy", "data_parallel_random_init",
              "use_cpu_initialization"),
    **_family(_OTHER_FAMILIES, "apply_dsa_kernel_fusion", "csa_dense_mode", "use_fused_mhc",
              "mhc_recompute_layer_num"),
    **_family(_ROPE, "rope_scaling", "max_model_len"),
    **_family(_PP_SPLIT, "account_for_embedding_in_pipeline_split",
              "account_for_loss_in_pipeline_split"),
    **_family(_P2P, "overlap_p2p_comm", "batch_p2p_comm"),
    **_family(_OVERLAP_TUNING, "overlap_param_gather_with_optimizer_step", "align_param_gather",
              "align_grad_reduce", "nccl_comm_warmup"),
    **_family(_LORA_SHAPE, "lora_bias", "lora_dtype"),
    **_family(_MULTIMODAL, "vit_gradient_checkpointing_kwargs"),
    **_family("LoRA is swift-megatron's own (adapters in PEFT's file format): drop the flag",
              "tuner_backend", "use_swift_lora"),
    # one of a kind
    "local_rank": "not needed: torchrun sets each process's LOCAL_RANK; launch N processes with "
                  "NPROC_PER_NODE=N",
    "te_rng_tracker": "Transformer Engine's RNG tracker " + _TE,
    "optimizer_cuda_graph": "CUDA-graph capture of the optimizer step " + _TE,
    "moe_enable_deepep": "DeepEP's token dispatcher is not supported: tokens move with "
                         "megatron-core's all-to-all dispatcher",
    "cp_partition_mode": "context parallelism splits each sequence in megatron's load-balanced "
                         "zigzag layout (2 x CP chunks), the only one: drop the flag",
    "sequence_parallel_size": "ms-swift derives it from --context_parallel_size: use that",
    "interleave_prob": "several datasets are concatenated (ms-swift's default); interleaving "
                       "is not supported: sample each with --dataset FILE#N",
    "stopping_strategy": "several datasets are concatenated (see --interleave_prob)",
    "group_by_length": "GRPO trains on generated completions: --max_tokens_per_micro_batch forms "
                       "micro-batches by length",
    "data_sharding": "prompts are always sharded over the data-parallel ranks by the sampler",
    "model_name": "self-cognition datasets (an SFT feature) are not supported",
    "model_author": "self-cognition datasets (an SFT feature) are not supported",
    "calculate_per_token_loss": "the GRPO loss is normalized as --loss_type says",
    "task_type": "GRPO trains causal language models (ms-swift's causal_lm): drop the flag",
    "megatron_extra_kwargs": "every megatron-core option swift-megatron supports is a flag "
                             "(megatron rlhf --help)",
    "callbacks": "ms-swift's trainer callbacks are not supported: reward functions, reward "
                 "models and multi-turn schedulers are plugins (--external_plugins)",
    "ignore_args_error": "argument errors always stop the command (exit code 2)",
    "enable_npu_model_patch": "Ascend NPUs are not supported",
    "linear_decoupled_in_proj": "Gated DeltaNet's input projection keeps the checkpoint's "
                                "layout: drop the flag",
    "move_model_batches": "weights are synced in buckets of --weight_sync_bucket_mb MiB: use that",
    "vllm_server_group_port": "the weight-sync group's port is chosen by the rollout server "
                              "(megatron rollout) and sent to the trainer",
    "wandb_log_unique_prompts": "completions go to completions.jsonl and the run report's "
                                "completions page (--log_completions)",
    "create_checkpoint_symlink": "the save directory's `latest` file names the newest "
                                 "checkpoint; --save_total_limit keeps the best by reward/mean",
    "accumulate_allreduce_grads_in_fp32": "gradients are always accumulated and reduced in "
                                          "float32 (megatron's grad_reduce_in_fp32): drop the "
                                          "flag",
    "hub_token": "the hub clients' own login is used: `huggingface-cli login` or HF_TOKEN "
                 "(--use_hf true), `modelscope login` for ModelScope",
    "stop_words": "generation stops at the tokenizer's end-of-sequence tokens and "
                  "--max_completion_length; stop strings are not supported",
    "structured_outputs_regex": "guided (structured) decoding is not supported",
    "val_dataset_shuffle": "every evaluation covers all validation prompts, so their order "
                           "does not matter: drop the flag",
    "strict": "a bad dataset row always stops the run naming the dataset and row (ms-swift's "
              "--strict true): fix or drop the row",
}
# Megatron-LM's manual garbage collection
_FAMILY_NAMES.update(_family("Python's garbage collector runs automatically (vLLM freezes its "
                             "start-up heap, so full collections are rare; perf/gc_pause_s "
                             "logs their cost): drop the flag",
                             "manual_gc", "manual_gc_steps", "manual_gc_eval"))
# families by name pattern: every name matching one gets its reason
FAMILIES: Tuple[Tuple[str, str], ...] = (
    (r"muon_.*", _OPTIMIZER),
    (r"fp[48]_.*", _FP8),
    (r"packing_.*", _PACKING),
    (r"mtp_.*", _MTP),
    (r"dsa_.*", _OTHER_FAMILIES),
)

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
    "pipeline_model_parallel_layout": "megatron's layout strings (a layer count per stage, "
                                      "the embedding, loss and MTP placement) are not "
                                      "supported: split unevenly with "
                                      "--decoder_first_pipeline_num_layers / "
                                      "--decoder_last_pipeline_num_layers (the other stages "
                                      "share the rest equally)",
    # not planned
    "use_ray": "swift-megatron launches with torchrun, not Ray: pass the flags of the `train:` and "
               "`rollout:` sections as ordinary flags, NPROC_PER_NODE for `gpus`, and "
               "--vllm_mode colocate (colocate_groups) or server (a `megatron rollout` server)",
    "colocate_groups": _RAY,
    "bridge_backend": "swift-megatron has its own bridge (swift_megatron/bridge)",
    "optimizer": _OPTIMIZER,
    "use_megatron_fsdp": _FSDP,
    "tp_comm_overlap": "tensor-parallel communication overlap " + _TE,
    "packing": "not needed: each micro-batch's sequences are packed already (--padding_free "
               "true, the default)",
    "streaming": _STREAMING,
    "save_strategy": "checkpoints are saved every --save_steps optimizer steps",
    "metric_for_best_model": _BEST,
    "use_vllm_lora": "vLLM LoRA adapters are not supported: weights are synced merged",
    "vllm_enable_lora": "vLLM LoRA adapters are not supported: weights are synced merged",
    "template": _TEMPLATE,
    "custom_register_path": "custom model registration is not supported",
    **_FAMILY_NAMES,
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
    reason = NOT_SUPPORTED.get(name) or next(
        (text for pattern, text in FAMILIES if re.fullmatch(pattern, name)), None)
    if reason:
        return f"ms-swift flag not supported here: {reason}"
    if name in HINTS:
        return f"use {HINTS[name]}"
    return None
