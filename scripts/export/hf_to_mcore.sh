#!/usr/bin/env bash
# HF -> Megatron: convert a Hugging Face checkpoint into a Megatron model directory
# (swift_megatron.json + hf/ + model/), loading it with TP x PP processes (TP=2, PP=2: 4
# processes through NPROC_PER_NODE), then check the written directory against the HF model in
# float32 (--test_convert_precision). The directory loads later in any layout, for training or
# for `megatron export --to_hf`.
#
#   bash scripts/export/hf_to_mcore.sh                                    # Qwen/Qwen3-1.7B (ModelScope)
#   MODEL=/path/to/hf_model TP=2 PP=1 OUTPUT_DIR=output/my-mcore bash scripts/export/hf_to_mcore.sh
#
# Variables: MODEL (hub id or local directory), TP, PP, DTYPE (default: the checkpoint's),
# OUTPUT_DIR. Extra flags are passed on: --use_hf true downloads hub ids from Hugging Face
# instead of ModelScope, --dry_run true only prints the plan.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-1.7B}
TP=${TP:-2}
PP=${PP:-2}
OUTPUT_DIR=${OUTPUT_DIR:-output/$(basename "$MODEL")-mcore}
DTYPE_FLAG=${DTYPE:+--torch_dtype $DTYPE}

NPROC_PER_NODE=$((TP * PP)) \
megatron export \
    --model "$MODEL" \
    --to_mcore true \
    --tensor_model_parallel_size "$TP" \
    --pipeline_model_parallel_size "$PP" \
    $DTYPE_FLAG \
    --test_convert_precision true \
    --output_dir "$OUTPUT_DIR" \
    "$@"
