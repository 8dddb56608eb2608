"""Merging a PEFT adapter into its HF base model as an HF checkpoint, through the bridge's single
export path (`megatron export --model HF_DIR --adapters PEFT_DIR --merge_lora true --output_dir
OUT` does the same through convert.py).

A LoRA model in memory merges on export: `Bridge.export(model)` yields merged HF weights,
W + scale * B A, computed out of place per tensor on each rank's shard before the TP gather (the
`bridge_export` hook, lora/layers.py); the base weights are never modified and no lora_* tensor
is yielded. Weight sync to rollout engines and `Bridge.save_hf` therefore see the merged model.
For a merged Megatron model, `merge_and_unload` (lora/layers.py) folds the adapters into the
weights in place.
"""
from typing import TYPE_CHECKING, Optional

from swift_megatron.checkpoint.loaded_model import load_mcore_model
from swift_megatron.errors import UserError

if TYPE_CHECKING:
    import torch

    from swift_megatron.parallel.state import ParallelState


def merge_adapter_into_hf(base_hf_dir: str, adapter_dir: str, out_dir: str,
                          state: "ParallelState", *, dtype: Optional["torch.dtype"] = None,
                          max_shard_size: str = "5GB", exist_ok: bool = False) -> None:
    """Build the model of the current layout, load the base weights through the bridge and the
    adapter on top, and write the merged model as an HF checkpoint in `dtype` (default: the base
    checkpoint's dtype; the merge itself is computed in float32). Collective."""
    from swift_megatron.bridge.hf_checkpoint import check_output_dir
    from swift_megatron.lora.peft_io import load_adapter, read_adapter
    from swift_megatron.model.config import DTYPES, load_hf_config, model_shape

    check_output_dir(out_dir, exist_ok)
    read_adapter(adapter_dir)  # fail on a bad adapter before building anything
    hf_config = load_hf_config(base_hf_dir)
    shape = model_shape(hf_config)
    if dtype is None and shape.torch_dtype not in DTYPES:
        raise UserError(f"{base_hf_dir}: dtype {shape.torch_dtype!r} is not supported; pass a "
                        f"dtype ({', '.join(DTYPES)})")
    dtype = dtype or DTYPES[shape.torch_dtype]
    loaded = load_mcore_model(hf_config, shape.model_type, dtype, state, hf_dir=base_hf_dir)
    load_adapter(loaded.model, adapter_dir, loaded.bridge)
    loaded.bridge.save_hf(loaded.model, out_dir, source_dir=base_hf_dir, dtype=dtype,
                          max_shard_size=max_shard_size, exist_ok=exist_ok)
