"""A frozen vision tower's outputs, computed once per image per GRPO rollout batch.

Every pass over a rollout batch (old-policy and reference logprobs, each training micro-batch,
each --num_iterations pass) would run the vision tower over the same images again. A frozen
tower (nothing in the `visual` module requires grad: ms-swift's default --freeze_vit and
--freeze_aligner true) without dropout gives the same outputs for the same pixels every time,
so inside `frozen_tower_cache(...)` (the trainer wraps a rollout batch's passes in it) each such
model keeps a `TowerCache`: the merged image embeddings (and Qwen3-VL's deepstack features) of
each image, computed without grad the first time a micro-batch shows it and reused afterwards;
all of it is dropped when the block ends. A tower with any parameter requiring grad, or with
dropout, gets no cache and runs in every pass.

Images are named by the micro-batches' `image_keys` (rlhf/grpo/batch.py): (group id, index of
the image in its prompt). A group's completions share their prompt's images and a group id names
one prompt within a rollout batch, so a group's images also run once, not once per completion.

Models whose towers are one module (the LoRA policy and its reference, the same model with its
adapters off: LoRA never adapts the tower) or hold equal tensors (a frozen reference copy of the
starting weights) share one cache. The cache is on the device of the tower: per distinct image,
its merged tokens x the tower's output hidden size x the dtype's bytes, times 1 + the number of
deepstack layers (Qwen3-VL).
"""
import contextlib
from typing import Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

import torch

from swift_megatron.model.wrappers import unwrap

TowerOutputs = Tuple[torch.Tensor, Optional[List[torch.Tensor]]]   # [N, h], deepstack [N, h]s
VISUAL = "visual"  # the vision tower's attribute (and parameter prefix) in the Megatron model


def tower_outputs(visual: torch.nn.Module, pixel_values: torch.Tensor,
                  image_grid_thw: torch.Tensor) -> TowerOutputs:
    """The tower's merged image embeddings [N, h] of all images (in order) and its deepstack
    features (None without deepstack)."""
    out = visual(pixel_values.to(visual.dtype), grid_thw=image_grid_thw)
    return out.pooler_output, getattr(out, "deepstack_features", None) or None


class TowerCache:
    """Per image key: its rows of the tower's outputs (the module docstring)."""

    def __init__(self):
        self.entries: Dict[Hashable, TowerOutputs] = {}

    @torch.no_grad()
    def outputs(self, visual: torch.nn.Module, pixel_values: torch.Tensor,
                image_grid_thw: torch.Tensor, keys: Sequence[Hashable]) -> TowerOutputs:
        """`tower_outputs` of the images named `keys`; the tower runs on the ones not seen yet
        (each distinct key once)."""
        if len(keys) != image_grid_thw.shape[0]:
            raise ValueError(f"{len(keys)} image keys for {image_grid_thw.shape[0]} images")
        patches = image_grid_thw.prod(-1).tolist()
        starts = [sum(patches[:i]) for i in range(len(patches))]
        new: Dict[Hashable, int] = {}
        for i, key in enumerate(keys):
            if key not in self.entries and key not in new:
                new[key] = i
        if new:
            index = list(new.values())
            pixels = torch.cat([pixel_values[starts[i]:starts[i] + patches[i]] for i in index])
            image, features = tower_outputs(visual, pixels, image_grid_thw[index])
            counted = sum(patches[i] for i in index)   # tokens per image: its patches / merge²
            sizes = [patches[i] * image.shape[0] // counted for i in index]
            rows = zip(image.split(sizes), *(f.split(sizes) for f in features or ()))
            for key, (embeds, *deep) in zip(new, rows):
                self.entries[key] = (embeds, deep or None)
        image = torch.cat([self.entries[k][0] for k in keys])
        deep = self.entries[keys[0]][1]
        features = None if deep is None else [
            torch.cat([self.entries[k][1][layer] for k in keys]) for layer in range(len(deep))]
        return image, features


def cacheable(visual: torch.nn.Module) -> bool:
    """Whether a tower's outputs are a fixed function of its pixels: no parameter requires grad
    and no dropout (a Dropout with p > 0, or an `attention_dropout` > 0)."""
    def drops(module: torch.nn.Module) -> bool:
        rate = getattr(module, "attention_dropout", 0)
        return (isinstance(module, torch.nn.Dropout) and module.p > 0) or \
            (isinstance(rate, (int, float)) and rate > 0)

    return not any(p.requires_grad for p in visual.parameters()) and \
        not any(drops(m) for m in visual.modules())


def same_tower(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two towers are one module or hold equal parameters and buffers (a tower in host
    memory, its device storage freed by --offload_ref_model, counts as another)."""
    if a is b:
        return True
    tensors = [dict(m.named_parameters()) | dict(m.named_buffers()) for m in (a, b)]
    if tensors[0].keys() != tensors[1].keys() or any(
            t.numel() and not t.untyped_storage().nbytes() for d in tensors for t in d.values()):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and
               torch.equal(x, y) for name, x in tensors[0].items() for y in [tensors[1][name]])


@contextlib.contextmanager
def frozen_tower_cache(*models: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside the block, every given model chunk (DDP-wrapped or not) holding a cacheable tower
    (`cacheable`) computes each image's tower outputs once; chunks with the same tower
    (`same_tower`) share them. Lists may be None (no such model)."""
    holders = [m for chunks in models if chunks for m in map(unwrap, chunks)
               if getattr(m, VISUAL, None) is not None and cacheable(getattr(m, VISUAL))]
    caches: List[Tuple[torch.nn.Module, TowerCache]] = []
    for model in holders:
        visual = getattr(model, VISUAL)
        shared = next((c for v, c in caches if same_tower(v, visual)), None)
        if shared is None:
            shared = TowerCache()
            caches.append((visual, shared))
        model.tower_cache = shared
    try:
        yield
    finally:
        for model in holders:
            model.tower_cache = None
