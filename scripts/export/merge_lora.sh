#!/usr/bin/env bash
# Merge a LoRA adapter into its base model and write a Hugging Face checkpoint that
# transformers and vLLM load as it is (the same weights as peft's merge_and_unload).
#
#   MODEL=Qwen/Qwen3-1.7B ADAPTER=output/grpo_lora/final_adapter bash scripts/export/merge_lora.sh
#   CKPT=output/grpo_lora/iter_0000200 bash scripts/export/merge_lora.sh   # from a training checkpoint
#
# ADAPTER: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), such as the
# final_adapter/ a `--train_type lora` run writes, or one made by peft itself.
# CKPT: instead, a `--save` iteration directory of a LoRA run (base weights + adapters).
# OUT (default: <model or checkpoint name>-merged) must not exist unless EXIST_OK=true.
set -euo pipefail
EXIST_OK=${EXIST_OK:-false}
if [ -n "${CKPT:-}" ]; then
    OUT=${OUT:-$(basename "$CKPT")-merged}
    megatron export --mcore_adapter "$CKPT" --merge_lora true --to_hf true \
        --output_dir "$OUT" --exist_ok "$EXIST_OK" "$@"
else
    MODEL=${MODEL:-Qwen/Qwen3-1.7B}
    ADAPTER=${ADAPTER:?set ADAPTER to a PEFT adapter directory (or CKPT to a LoRA checkpoint)}
    OUT=${OUT:-$(basename "$MODEL")-merged}
    megatron export --model "$MODEL" --adapters "$ADAPTER" --merge_lora true \
        --output_dir "$OUT" --exist_ok "$EXIST_OK" "$@"
fi
echo "merged model: $OUT"
