#!/usr/bin/env bash
# Precision check only: load the Hugging Face model into Megatron (TP processes through
# NPROC_PER_NODE; PP and EP work too) and run it and transformers in float32 on the same random
# tokens. Prints the max / mean absolute logit difference and the argmax agreement; exits
# non-zero when the max difference exceeds ATOL. Nothing is written.
#
#   bash scripts/export/precision_check.sh                            # Qwen/Qwen3-1.7B, TP=2
#   MODEL=/path/to/hf_model TP=1 ATOL=1e-4 bash scripts/export/precision_check.sh
# Extra flags are passed on (e.g. --test_convert_dtype bfloat16, --dry_run true).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-1.7B}
TP=${TP:-2}

NPROC_PER_NODE=$TP \
megatron export \
    --model "$MODEL" \
    --tensor_model_parallel_size "$TP" \
    --test_convert_precision true \
    --test_convert_precision_atol "${ATOL:-1e-4}" \
    "$@"
