#!/usr/bin/env bash
# LoRA exports in ms-swift's forms (its examples/megatron/export/lora.sh and merge_lora.sh run here
# with the same flags). CKPT is a LoRA checkpoint: ours (a --save iteration directory of a
# --train_type lora run) or ms-swift's (checkpoint-N, with the PEFT files it saves beside its
# distributed checkpoint). MODEL is the base model; its weights are the ones merged.
#
#   MODE=peft          the adapter alone, in PEFT format (--merge_lora false)    -> CKPT-lora
#   MODE=merged_hf     base + adapter merged into an HF checkpoint               -> CKPT-merged-hf
#   MODE=merged_mcore  base + adapter merged into a Megatron model directory     -> CKPT-merged
#   MODE=to_mcore      the PEFT adapter ADAPTER on MODEL as a Megatron LoRA checkpoint, which
#                      --mcore_adapter reads                                      -> ADAPTER-mcore
#
#   MODEL=Qwen/Qwen3-1.7B CKPT=output/grpo_lora/iter_0000200 MODE=peft bash scripts/export/lora_forms.sh
#   MODEL=Qwen/Qwen3-1.7B ADAPTER=output/grpo_lora/final_adapter MODE=to_mcore \
#       bash scripts/export/lora_forms.sh
#
# TP processes (TP=2 by default, through NPROC_PER_NODE). Extra flags are passed on
# (e.g. --exist_ok true, --dry_run true).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-1.7B}
MODE=${MODE:-merged_hf}
TP=${TP:-2}
export NPROC_PER_NODE=$TP
layout=(--tensor_model_parallel_size "$TP")

case "$MODE" in
    peft)
        CKPT=${CKPT:?set CKPT to a LoRA checkpoint}
        megatron export --model "$MODEL" --mcore_adapter "$CKPT" --to_hf true \
            --merge_lora false --output_dir "${CKPT%/}-lora" "${layout[@]}" "$@" ;;
    merged_hf)
        CKPT=${CKPT:?set CKPT to a LoRA checkpoint}
        megatron export --model "$MODEL" --mcore_adapter "$CKPT" --to_hf true \
            --merge_lora true --output_dir "${CKPT%/}-merged-hf" "${layout[@]}" \
            --test_convert_precision true "$@" ;;
    merged_mcore)
        CKPT=${CKPT:?set CKPT to a LoRA checkpoint}
        megatron export --model "$MODEL" --mcore_adapter "$CKPT" --to_mcore true \
            --merge_lora true --output_dir "${CKPT%/}-merged" "${layout[@]}" "$@" ;;
    to_mcore)
        ADAPTER=${ADAPTER:?set ADAPTER to a PEFT adapter directory}
        megatron export --model "$MODEL" --adapters "$ADAPTER" --to_mcore true \
            --merge_lora false --output_dir "${ADAPTER%/}-mcore" "${layout[@]}" \
            --test_convert_precision true "$@" ;;
    *)
        echo "MODE must be peft, merged_hf, merged_mcore or to_mcore, got '$MODE'" >&2
        exit 2 ;;
esac
