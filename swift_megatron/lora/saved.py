"""Modules trained in full beside the LoRA adapters (peft's and ms-swift's `modules_to_save`): the
word embedding and the output layer.

`train_in_full(model, modules)` makes a module's weight trainable and keeps a frozen copy of
the base weight beside it, the buffer `lora_base_weight`:
- the trained weight stays the module's `weight`, so the optimizer, checkpoints, the bridge's
  export (merged HF checkpoints, weight sync to rollout engines) and merging see it unchanged;
- `base_weights(model)` (entered by `lora.disabled`) swaps the base copy in, for the reference
  logprobs and a base-model export, as peft's ModulesToSaveWrapper does with adapters disabled;
- the base copy is checkpointed beside the weight, sharded as it is, so a resumed run keeps its
  reference, and a model without adapters that loads a LoRA checkpoint's weights takes the base
  (checkpoint/dist.py).
On a model with tied embeddings the embedding and the output layer are one matrix: naming either
trains it, and the output layer's copy on the last pipeline stage with it (megatron's embedding
gradient all-reduce keeps the two equal; that copy's base is not checkpointed twice).

In PEFT files the modules' full tensors are stored under their HF names
(`base_model.model.model.embed_tokens.weight`, `base_model.model.lm_head.weight`) and
adapter_config.json lists the HF module names in `modules_to_save`, as peft writes them; a model
with tied embeddings writes both names with the one tensor and `ensure_weight_tying`.
"""
import contextlib
import dataclasses
from typing import Dict, Iterator, List, Sequence

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

from swift_megatron.arguments.lora import EMBEDDING, OUTPUT_LAYER
from swift_megatron.bridge.io import TensorReader
from swift_megatron.bridge.load import find_mapping

BASE = "lora_base_weight"
HEAD = "lm_head.weight"   # transformers' output layer in every family (tied: the embedding)


class _SavedMixin:
    """The base copy in the sharded state dict, sharded as the weight (the base classes would
    drop it, or call it replicated)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        weight = sharded[f"{prefix}weight"]
        sharded[f"{prefix}{BASE}"] = dataclasses.replace(weight, key=f"{prefix}{BASE}",
                                                         data=getattr(self, BASE))
        return sharded


class SavedVocabParallelEmbedding(_SavedMixin, VocabParallelEmbedding):
    """The word embedding, trained in full with its base copy."""


class SavedColumnParallelLinear(_SavedMixin, ColumnParallelLinear):
    """The output layer, trained in full with its base copy."""


SAVED_CLASSES = {VocabParallelEmbedding: SavedVocabParallelEmbedding,
                 ColumnParallelLinear: SavedColumnParallelLinear}


def modules_on_stage(model: torch.nn.Module, names: Sequence[str]) -> Dict[str, torch.nn.Module]:
    """{name: module} of this stage's modules among `names` that hold a weight of their own
    (with tied embeddings either name selects both)."""
    if model.share_embeddings_and_output_weights and set(names) & {EMBEDDING, OUTPUT_LAYER}:
        names = (EMBEDDING, OUTPUT_LAYER)
    out = {}
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:   # not on this pipeline stage
            continue
        if getattr(module, "weight", None) is not None:
            out[name] = module
    return out


def train_in_full(model: torch.nn.Module, names: Sequence[str]) -> List[torch.nn.Module]:
    """Make the modules `names` (Megatron paths) of this stage's GPTModel train in full with a
    base copy (module docstring); before DDP wrapping. Returns the modules."""
    modules = modules_on_stage(model, names)
    for name, module in modules.items():
        tied_copy = name == OUTPUT_LAYER and model.share_embeddings_and_output_weights
        module.register_buffer(BASE, module.weight.detach().clone(), persistent=not tied_copy)
        module.lora_saved_name = name
        if not tied_copy:
            module.__class__ = SAVED_CLASSES[type(module)]
        module.weight.requires_grad_(True)
    return list(modules.values())


def saved_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of a model (DDP-wrapped or not) trained in full beside the adapters."""
    return [m for m in model.modules() if BASE in m._buffers]


@contextlib.contextmanager
def base_weights(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block every module trained in full has its base weight as `weight` (the
    forward, the output layer's logprobs and the bridge's export all see the base model)."""
    modules = saved_modules(model)
    trained = [m._parameters["weight"] for m in modules]
    for module in modules:
        module._parameters["weight"] = torch.nn.Parameter(getattr(module, BASE),
                                                          requires_grad=False)
    try:
        yield
    finally:
        for module, weight in zip(modules, trained):
            module._parameters["weight"] = weight


def unload(model: torch.nn.Module) -> None:
    """Keep the trained weights, drop the base copies (merge_and_unload)."""
    plain = {saved: base for base, saved in SAVED_CLASSES.items()}
    for module in saved_modules(model):
        del module._buffers[BASE]
        del module.lora_saved_name
        module.__class__ = plain.get(type(module), type(module))


# ---- PEFT files ------------------------------------------------------------------------------

def _global_names(model: torch.nn.Module, names: Sequence[str]) -> List[str]:
    """The global Megatron weight names of the modules `names` (tied: the embedding's, the one
    matrix the bridge exports)."""
    if model.share_embeddings_and_output_weights and set(names) & {EMBEDDING, OUTPUT_LAYER}:
        return [f"{EMBEDDING}.weight"]
    return [f"{name}.weight" for name in names]


def saved_tensors(model: torch.nn.Module, names: Sequence[str], bridge) -> Dict[str, torch.Tensor]:
    """{HF name: full tensor} of the modules `names` trained in full, on every rank, through the
    bridge's export; with tied embeddings the one matrix under the embedding's and lm_head's
    names. Collective."""
    if not names:
        return {}
    tensors = {n: t.detach().cpu() for n, t in bridge.export(model, _global_names(model, names))}
    if model.share_embeddings_and_output_weights:
        tensors[HEAD] = tensors[_hf_embedding(bridge)].clone()
    return tensors


def load_saved(model: torch.nn.Module, tensors: Dict[str, torch.Tensor], bridge,
               path: str) -> List[str]:
    """Copy this rank's slices of the modules trained in full from a PEFT file's tensors (HF
    names), through the bridge's mappings; returns the problems found (missing tensor, shape,
    an lm_head that a tied model cannot hold apart from its embedding)."""
    problems, reader = [], TensorReader(tensors)
    for module in saved_modules(model):
        mapping, index = find_mapping(bridge.mappings, f"{module.lora_saved_name}.weight")
        hf_names = mapping.hf_names(index)
        missing = [n for n in hf_names if n not in tensors]
        if missing:
            problems += [f"missing tensor {n} ({path}: modules_to_save)" for n in missing]
            continue
        tensor = mapping.load(reader, hf_names, bridge.pos.shard(False), bridge.dims)
        if tuple(tensor.shape) != tuple(module.weight.shape):
            problems.append(f"shape of {hf_names[0]} {tuple(tensors[hf_names[0]].shape)}")
            continue
        with torch.no_grad():
            module.weight.copy_(tensor)
    return problems + _untied_head(model, tensors, bridge)


def _hf_embedding(bridge) -> str:
    """The word embedding's HF tensor name in this family."""
    return find_mapping(bridge.mappings, f"{EMBEDDING}.weight")[0].hf_names({})[0]


def _untied_head(model: torch.nn.Module, tensors: Dict[str, torch.Tensor], bridge) -> List[str]:
    """A tied model holds one matrix: an lm_head that differs from the embedding is refused."""
    if not model.share_embeddings_and_output_weights or HEAD not in tensors:
        return []
    embedding = _hf_embedding(bridge)
    if embedding in tensors and torch.equal(tensors[embedding], tensors[HEAD]):
        return []
    return [f"{HEAD} differs from {embedding}, but this model ties them (peft trained them apart: "
            "save the adapter with ensure_weight_tying)"]
