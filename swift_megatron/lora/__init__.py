"""LoRA for Megatron-core parallel linears (TP/PP/EP aware), PEFT-format adapters, merging.

    config = LoraConfig(r=8, lora_alpha=32, target_modules=("all-linear",))
    apply_lora(model, config)            # before DDP wrapping; freezes everything else (but
                                         # config.modules_to_save, trained in full)
    with disabled(model): ...            # the base model (e.g. GRPO reference logprobs)
    save_adapter(model, out_dir, base_model_name_or_path, config, bridge)  # PEFT, collective
    load_adapter(model, adapter_dir, bridge)  # PEFT format (adds adapters if needed), collective
    bridge.export(model)                 # merged HF weights (W + scale * B A), base untouched
    merge_and_unload(model)              # adapters folded into the weights and removed

layers.py: the LoRA linears and the model-level API; targets.py: LoraConfig and which mcore
linears hold which HF projections; saved.py: the modules trained in full beside the adapters
(modules_to_save); peft_io.py: the PEFT file format. A PEFT adapter merged into
its HF base as an HF checkpoint: export/merge.py (`merge_adapter_into_hf`).
"""
from swift_megatron.lora.layers import (adapter_parameters, apply_lora, disabled, lora_modules,
                                        merge_and_unload)
from swift_megatron.lora.peft_io import (adapter_state_dict, load_adapter, read_adapter,
                                         read_adapter_config, save_adapter)
from swift_megatron.lora.targets import HF_PROJECTIONS, LoraConfig

__all__ = ["HF_PROJECTIONS", "LoraConfig", "adapter_parameters", "adapter_state_dict",
           "apply_lora", "disabled", "load_adapter", "lora_modules", "merge_and_unload",
           "read_adapter", "read_adapter_config", "save_adapter"]
