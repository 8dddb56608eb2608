"""LoRA adapters inside an ms-swift Megatron checkpoint's distributed checkpoint, converted to a
PEFT adapter (exactly), for the LoRA checkpoints ms-swift saves without PEFT files beside them.

ms-swift (mcore-bridge's LoraParallelLinear: peft on megatron-core modules) puts one adapter on
each megatron linear and saves only those tensors (`_filter_adapter_state_dict`), under
`<module>.lora_A.default.weight` [r, in] and `<module>.lora_B.default.weight` [out, r], with the
layers stacked on a leading axis (or `decoder.layers.<i>.` per layer) and routed experts on a
second one. As full (global) tensors:

    linear_qkv   A shared by q, k and v; B rows in the fused layout (q, k, v per query group)
    linear_fc1   A shared by gate and up; B rows as the TP ranks held them: [gate of rank 0;
                 up of rank 0; gate of rank 1; ...] for the run's TP (args.json), unlike the
                 base weight, which megatron stores as [gate; up]
    linear_proj, linear_fc2: one projection each; experts as the dense MLP (ETP = 1: ms-swift's
                 LoRA does not support expert TP)

Our adapters are per HF projection, so each of q, k, v (gate, up) gets A copied and its rows of
B: W + s B_q A is exactly the q rows of W + s B A. The bridge's QKV / GateUp mappings split the
rows. Reads full tensors on the calling process only (adapters are small); no process group.
"""
import json
import os
import re
from typing import Dict, List

import torch

from swift_megatron.bridge.mapping import QKV, Dims, GateUp
from swift_megatron.checkpoint.ms_swift import MsSwiftCheckpoint, stored_keys
from swift_megatron.errors import UserError
from swift_megatron.model.text_config import HYBRID_TYPES, text_config

_KEY = re.compile(r"^decoder\.layers\.(?:(?P<layer>\d+)\.)?(?P<module>.+)\.lora_(?P<matrix>[AB])"
                  r"\.default\.weight$")
EXPERTS = "mlp.experts.experts."
# megatron module -> the HF projections it holds ({expert}: one per routed expert)
PROJECTIONS = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
    EXPERTS + "linear_fc1": ("mlp.experts.{expert}.gate_proj", "mlp.experts.{expert}.up_proj"),
    EXPERTS + "linear_fc2": ("mlp.experts.{expert}.down_proj",),
}
PEFT_PREFIX = "base_model.model."


def adapter_keys(checkpoint: MsSwiftCheckpoint) -> List[str]:
    """The LoRA tensor keys of the distributed checkpoint; UserError for adapters on modules we
    do not adapt (e.g. the router) and for modules trained in full (not converted)."""
    if checkpoint.args.get("modules_to_save"):
        raise UserError(f"{checkpoint.directory}: its modules_to_save "
                        f"{checkpoint.args['modules_to_save']} are not read from an ms-swift "
                        "distributed checkpoint: save the adapter with ms-swift in PEFT format "
                        "(--save_safetensors true) and pass that directory")
    keys = sorted(k for k in stored_keys(checkpoint.iter_dir) if _KEY.match(k))
    unknown = sorted({_KEY.match(k).group("module") for k in keys} - set(PROJECTIONS))
    if unknown:
        raise UserError(f"{checkpoint.directory}: LoRA on {', '.join(unknown)} is not supported "
                        f"(only on {', '.join(PROJECTIONS)})")
    if not keys:
        raise UserError(f"{checkpoint.directory}: no LoRA tensors in "
                        f"{os.path.basename(checkpoint.iter_dir)}/ and no PEFT adapter beside it")
    return keys


def peft_config(checkpoint: MsSwiftCheckpoint, keys: List[str]) -> dict:
    """adapter_config.json of the converted adapter, from args.json and the adapted modules."""
    from swift_megatron.lora import LoraConfig
    from swift_megatron.lora.peft_io import peft_config_dict

    a = checkpoint.args
    targets = sorted({hf.rsplit(".", 1)[-1] for k in keys
                      for hf in PROJECTIONS[_KEY.match(k).group("module")]})
    config = LoraConfig(r=int(a.get("lora_rank", 8)), lora_alpha=a.get("lora_alpha", 32),
                        lora_dropout=float(a.get("lora_dropout", 0.0)), target_modules=targets,
                        use_rslora=bool(a.get("use_rslora", False)))
    return peft_config_dict(config, targets, checkpoint.base_model or "")


def _read_full(iter_dir: str, keys: List[str]) -> Dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(iter_dir).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
    dcp.load(tensors, storage_reader=FileSystemReader(iter_dir), no_dist=True)
    return tensors


def refuse_hybrid(hf_config: dict, path: str) -> None:
    """ms-swift lays out Qwen3.5's Gated DeltaNet and gated attention differently (in_proj grouped
    per key head, q and gate interleaved): its Megatron checkpoints of these are not read."""
    family = text_config(hf_config).get("model_type")
    if family in HYBRID_TYPES:
        raise UserError(f"{path}: ms-swift Megatron checkpoints of {family} are not supported "
                        "(their Gated DeltaNet layout differs); export it to HF with ms-swift "
                        "and start from that")


def _dims(hf_config: dict) -> Dims:
    heads = hf_config["num_attention_heads"]
    return Dims(num_heads=heads, num_query_groups=hf_config.get("num_key_value_heads") or heads,
                head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
                vocab_size=0, padded_vocab_size=0)


def _split_b(module: str, b: torch.Tensor, names: List[str], dims: Dims,
             args: dict) -> Dict[str, torch.Tensor]:
    """B [out, r] of one megatron linear -> {hf projection: its rows}."""
    if len(names) == 1:
        return {names[0]: b}
    if module == "self_attention.linear_qkv":
        return QKV("", *names).to_hf([b], names, dims)
    ranks = 1 if module.startswith(EXPERTS) else int(args.get("tensor_model_parallel_size") or 1)
    return GateUp("", *names).to_hf(list(b.chunk(ranks)), names, dims)


def _units(key: str, tensor: torch.Tensor):
    """(layer, expert or None, [r|out, ...] tensor) for every layer (and expert) in a tensor."""
    match = _KEY.match(key)
    layers = [(int(match.group("layer")), tensor)] if match.group("layer") else enumerate(tensor)
    for layer, per_layer in layers:
        if match.group("module").startswith(EXPERTS):
            for expert, unit in enumerate(per_layer):
                yield layer, expert, unit
        else:
            yield layer, None, per_layer


def convert(checkpoint: MsSwiftCheckpoint, hf_config: dict,
            keys: List[str]) -> Dict[str, torch.Tensor]:
    """{"base_model.model.<HF module>.lora_A.weight": tensor, ...}: the PEFT tensors."""
    refuse_hybrid(hf_config, checkpoint.directory)
    dims, out = _dims(hf_config), {}
    for key, tensor in _read_full(checkpoint.iter_dir, keys).items():
        module, matrix = _KEY.match(key).group("module", "matrix")
        for layer, expert, unit in _units(key, tensor):
            names = [f"model.layers.{layer}.{hf.format(expert=expert)}"
                     for hf in PROJECTIONS[module]]
            parts = ({name: unit.clone() for name in names} if matrix == "A"
                     else _split_b(module, unit, names, dims, checkpoint.args))
            out.update({f"{PEFT_PREFIX}{name}.lora_{matrix}.weight": t.contiguous()
                        for name, t in parts.items()})
    return out


def write_peft_adapter(checkpoint: MsSwiftCheckpoint, hf_config: dict, out_dir: str) -> None:
    """The checkpoint's adapter as a PEFT directory at `out_dir` (this process only)."""
    from safetensors.torch import save_file

    from swift_megatron.lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    keys = adapter_keys(checkpoint)
    os.makedirs(out_dir, exist_ok=True)
    save_file(convert(checkpoint, hf_config, keys), os.path.join(out_dir, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(checkpoint, keys), f, indent=2)
