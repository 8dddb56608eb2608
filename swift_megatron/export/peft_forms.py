"""The forms `megatron export` writes besides an HF checkpoint, and the adapter form it reads:

- a Megatron model directory (checkpoint/layout.py), with the adapter kept beside the weights
  in PEFT format under adapter/ when there is one (a LoRA checkpoint): `save_model_dir`;
- the adapter alone as a PEFT directory: `save_peft_dir`;
- an ms-swift adapter kept in its distributed checkpoint, converted into a PEFT directory to
  load (`as_peft`).

Outputs are written atomically (staging.py). Collective: call them on every rank.
"""
import dataclasses
import os
from typing import TYPE_CHECKING, Optional

from swift_megatron.checkpoint.loaded_model import LoadedModel
from swift_megatron.export.inputs import ExportInputs
from swift_megatron.export.staging import staged

if TYPE_CHECKING:
    from swift_megatron.lora import LoraConfig
    from swift_megatron.parallel.state import ParallelState


def save_model_dir(loaded: LoadedModel, out_dir: str, hf_source_dir: str,
                   state: "ParallelState", *, lora: Optional["LoraConfig"] = None,
                   base_name: Optional[str] = None) -> None:
    """Write a Megatron model directory (weights, HF config and tokenizer, meta) under a temporary
    name and rename it into place, replacing `out_dir`. With `lora` (a model carrying adapters),
    also its adapter in PEFT format under adapter/: a LoRA checkpoint. Collective."""
    from swift_megatron.bridge.hf_checkpoint import DTYPE_NAMES
    from swift_megatron.checkpoint.layout import write_model_dir
    from swift_megatron.checkpoint.sources import OUR_ADAPTER
    from swift_megatron.lora import save_adapter

    meta = {"model_type": loaded.shape.model_type, "dtype": DTYPE_NAMES[loaded.dtype],
            "saved_with": {"tp": state.tp, "pp": state.pp, "ep": state.ep, "etp": state.etp}}
    with staged(out_dir, state) as tmp:
        write_model_dir([loaded.model], tmp, hf_source_dir=hf_source_dir, meta=meta)
        if lora is not None:
            save_adapter(loaded.model, os.path.join(tmp, OUR_ADAPTER), base_name, lora,
                         loaded.bridge)


def save_peft_dir(loaded: LoadedModel, out_dir: str, base_name: str, lora: "LoraConfig",
                  state: "ParallelState") -> None:
    """Write the model's adapter as a PEFT directory, atomically (replacing `out_dir`)."""
    from swift_megatron.lora import save_adapter

    with staged(out_dir, state) as tmp:
        save_adapter(loaded.model, tmp, base_name, lora, loaded.bridge)


def as_peft(inputs: ExportInputs, tmp_dir: str) -> ExportInputs:
    """The inputs with an ms-swift adapter kept in its distributed checkpoint converted into a
    PEFT directory under `tmp_dir` (each process its own: no shared file system needed)."""
    if inputs.adapter is None or inputs.adapter.peft_dir:
        return inputs
    from swift_megatron.checkpoint.sources import peft_dir_of

    peft_dir = peft_dir_of(inputs.adapter, inputs.hf_config, tmp_dir)
    return dataclasses.replace(inputs, adapter=dataclasses.replace(inputs.adapter,
                                                                   peft_dir=peft_dir))
