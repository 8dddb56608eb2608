"""Loading a Megatron model to run: build the GPTModel of this rank's pipeline stage and load
its weights from an HF checkpoint (through the bridge) or a Megatron model directory (ours or an
ms-swift checkpoint, any layout), with a PEFT adapter on top when asked.

`megatron export` (conversion and the precision check), the LoRA merge and the tests and
benchmarks load models through `load_mcore_model`. Collective: call it on every rank.
"""
import dataclasses
from typing import TYPE_CHECKING, Optional

from swift_megatron.checkpoint.sources import WeightsSource, load_weights

if TYPE_CHECKING:
    import torch

    from swift_megatron.bridge import Bridge
    from swift_megatron.model.config import ModelShape
    from swift_megatron.parallel.state import ParallelState


@dataclasses.dataclass
class LoadedModel:
    """This rank's GPTModel (its pipeline stage) with the bridge and shape that describe it."""

    model: "torch.nn.Module"
    bridge: "Bridge"
    shape: "ModelShape"
    dtype: "torch.dtype"


def _weights(hf_dir: Optional[str], mcore_dir: Optional[str]) -> WeightsSource:
    from swift_megatron.checkpoint.ms_swift import is_ms_swift_checkpoint

    if hf_dir is not None:
        return WeightsSource("hf", hf_dir)
    return WeightsSource("ms_swift" if is_ms_swift_checkpoint(mcore_dir) else "mcore", mcore_dir)


def load_mcore_model(hf_config: dict, model_type: str, dtype: "torch.dtype",
                     state: "ParallelState", *, hf_dir: Optional[str] = None,
                     mcore_dir: Optional[str] = None, adapter_dir: Optional[str] = None,
                     sequence_parallel: bool = False) -> LoadedModel:
    """Build the model of the current layout (with sequence parallelism when asked, and the
    state's uneven pipeline split) and load it from an HF checkpoint (through the bridge) or
    from a Megatron checkpoint (our model directory or an ms-swift checkpoint, any layout); with
    `adapter_dir`, a PEFT adapter on top. Collective."""
    from swift_megatron.bridge import Bridge
    from swift_megatron.model.build import build_model

    if (hf_dir is None) == (mcore_dir is None):
        raise ValueError("load from exactly one of hf_dir and mcore_dir")
    model, config, shape = build_model(hf_config, dtype, state.device, model_type=model_type,
                                       random_init=False, sequence_parallel=sequence_parallel,
                                       **state.layer_split)
    bridge = Bridge(hf_config, shape, config)
    load_weights([model], _weights(hf_dir, mcore_dir), bridge)
    if adapter_dir is not None:
        from swift_megatron.lora import load_adapter

        load_adapter(model, adapter_dir, bridge)
    return LoadedModel(model.eval(), bridge, shape, dtype)
