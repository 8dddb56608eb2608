"""The GRPO prompt pipeline: load datasets, build chat prompts, hand them out per DP rank.

    from swift_megatron.data import PromptSampler, prepare_prompts
    train, val = prepare_prompts(args, tokenizer, max_position_embeddings=hf_config.max_position_embeddings)
    sampler = PromptSampler(len(train), rollout_prompts, dp_size, dp_rank, seed=args.seed,
                            shuffle=args.dataset_shuffle)
    sampler.load_state_dict(saved)          # when resuming
    for indices in sampler:                 # one rollout batch: this DP rank's prompts
        batch = [train[i] for i in indices] # Prompt(prompt_id, text, input_ids, messages, columns, truncated)

Modules: sources.py (a --dataset spec -> row dicts: local jsonl/json/csv/parquet files,
save_to_disk directories, ModelScope / Hugging Face hub ids, `#N` row samples), prompts.py (rows ->
Prompt: messages, chat template, tokens, left truncation, validation split), sampler.py (epochs,
seeded shuffling, DP sharding, resumable position), agent.py (--agent_template: tools in the
prompt, tool results between turns). User-facing documentation: docs/data.md.
Importing this package does not import torch or transformers.
"""
from swift_megatron.data.prompts import (Prompt, PromptSettings, align_columns, build_prompts,
                                         check_chat_template, load_prompts, max_prompt_length,
                                         prepare_prompts,
                                         rename_columns, row_messages, split_validation)
from swift_megatron.data.sampler import PromptSampler
from swift_megatron.data.sources import DatasetSpec, load_many, load_rows, parse_spec

__all__ = ["DatasetSpec", "Prompt", "PromptSampler", "PromptSettings", "align_columns", "build_prompts",
           "check_chat_template", "load_many", "load_prompts", "load_rows", "max_prompt_length",
           "parse_spec", "prepare_prompts", "rename_columns", "row_messages", "split_validation"]
