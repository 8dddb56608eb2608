#!/usr/bin/env bash
# Megatron -> HF: export a Megatron model directory (written by hf_to_mcore.sh or by training)
# back to a Hugging Face checkpoint (sharded safetensors + index, config, tokenizer) that
# transformers and vLLM load as is, then check it against the Megatron model in float32.
#
#   bash scripts/export/mcore_to_hf.sh                       # output/Qwen3-1.7B-mcore -> ...-hf
#   MCORE_MODEL=output/my-mcore OUTPUT_DIR=output/my-hf bash scripts/export/mcore_to_hf.sh
#
# Variables: MODEL (names the default directories, as in hf_to_mcore.sh), MCORE_MODEL,
# OUTPUT_DIR, DTYPE (default: the dtype the directory was saved in), MAX_SHARD_SIZE.
# One process is enough; NPROC_PER_NODE=N with --tensor_model_parallel_size N splits the model.
# MCORE_MODEL may also be an ms-swift Megatron checkpoint (iter_*/ + latest_checkpointed_iteration.txt).
# Extra flags are passed on (e.g. --dry_run true).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-1.7B}
MCORE_MODEL=${MCORE_MODEL:-output/$(basename "$MODEL")-mcore}
OUTPUT_DIR=${OUTPUT_DIR:-output/$(basename "$MODEL")-hf}
DTYPE_FLAG=${DTYPE:+--torch_dtype $DTYPE}

megatron export \
    --mcore_model "$MCORE_MODEL" \
    --to_hf true \
    $DTYPE_FLAG \
    --max_shard_size "${MAX_SHARD_SIZE:-5GB}" \
    --test_convert_precision true \
    --output_dir "$OUTPUT_DIR" \
    "$@"
