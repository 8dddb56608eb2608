"""Vision-language models on megatron-core: the language model is a GPTModel with M-RoPE, the
vision tower plus merger is transformers' own module, held by the first pipeline stage and
replicated over tensor parallelism (every TP rank computes it in full).

Families (`TOWERS`): Qwen2.5-VL (`qwen2_5_vl`, contiguous M-RoPE sections, megatron-core's
MultimodalRotaryEmbedding), Qwen3-VL (`qwen3_vl`: the qwen3 text stack, interleaved M-RoPE,
deepstack) and Qwen3.5 with its vision tower (`qwen3_5`, `qwen3_5_moe`: a
Qwen3_5ForConditionalGeneration config with `vision_config`). The frequency channels of
Qwen3-VL's and Qwen3.5's M-RoPE cycle t, h, w, t, h, w... (`InterleavedMRoPE`). A Qwen3.5
config without a `vision_config` (a text-only save) builds a plain GPTModel (`has_vision`).

`VisionGPTModel.forward` takes, besides GPTModel's arguments, `pixel_values` and
`image_grid_thw` (as the Qwen2-VL image processor returns them), and `image_keys` (names of
the images, for a frozen tower's per-rollout-batch cache: vision_cache.py). On the first stage
it embeds the tokens without the sequence-parallel scatter, writes the merged image embeddings
over the `image_token_id` positions of the prompts (as transformers' `masked_scatter`), then
scatters the sequence. `position_ids` are the 3-D M-RoPE ids [3, b, s]; 2-D ids [b, s]
(text-only batches, where the three axes are equal) are broadcast to the three axes.

Deepstack (Qwen3-VL): the tower also returns the merged features of some of its blocks
(`deepstack_visual_indexes`); transformers adds the k-th to the hidden states at the image
tokens after decoder layer k. Here the first stage passes them, cut to its sequence-parallel
chunk (their gradient summed over TP in the backward pass), to the decoder as the block's
`context` (with `context_mask` the image tokens of the chunk): megatron-core hands both to
every layer, also when full recomputation reruns a layer in the backward pass, and GPT layers
have no cross-attention that would read them. A forward
hook on each of the first layers (`_add_deepstack`) adds its features. Those layers must be on
the first pipeline stage (its first model chunk), which holds the features.
"""
import functools
import importlib
import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import \
    MultimodalRotaryEmbedding
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.gpt import GPTModel

from swift_megatron.errors import UserError
from swift_megatron.model.vision_cache import VISUAL, TowerCache, tower_outputs


class HFClasses(NamedTuple):
    """transformers' names of a vision-language family."""

    config: str   # the top-level config class
    module: str   # the modeling module, under transformers.models
    tower: str    # the vision transformer + merger
    model: str    # the model whose `get_rope_index` gives the 3-D positions


TOWERS = {
    "qwen2_5_vl": HFClasses("Qwen2_5_VLConfig", "qwen2_5_vl.modeling_qwen2_5_vl",
                            "Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLModel"),
    "qwen3_vl": HFClasses("Qwen3VLConfig", "qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel",
                          "Qwen3VLModel"),
    "qwen3_5": HFClasses("Qwen3_5Config", "qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel",
                         "Qwen3_5Model"),
    "qwen3_5_moe": HFClasses("Qwen3_5MoeConfig", "qwen3_5_moe.modeling_qwen3_5_moe",
                             "Qwen3_5MoeVisionModel", "Qwen3_5MoeModel"),
}
VISION_TYPES = tuple(TOWERS)
INTERLEAVED_MROPE = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
OPTIONAL_TOWER = ("qwen3_5", "qwen3_5_moe")  # text-only saves of these have no vision_config
# transformers' default `mrope_section` of each family when rope_parameters has none
DEFAULT_MROPE_SECTION = {"qwen3_vl": [24, 20, 20], "qwen3_5": [11, 11, 10],
                         "qwen3_5_moe": [11, 11, 10]}
# the micro-batch entries it takes (`image_keys`: vision_cache.py)
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "prompt_mask", "image_keys")


def has_vision(hf_config: Mapping[str, Any]) -> bool:
    """Whether an HF config.json describes a model with a vision tower this project builds:
    Qwen2.5-VL and Qwen3-VL always, Qwen3.5 when the config has a `vision_config`."""
    model_type = hf_config.get("model_type")
    return model_type in TOWERS and (model_type not in OPTIONAL_TOWER or
                                     hf_config.get("vision_config") is not None)


def takes_images(model_dir: str, hf_config: Mapping[str, Any]) -> bool:
    """Whether a checkpoint takes images: a vision tower (`has_vision`) and, for Qwen3.5, an
    image processor in its directory (a Qwen3.5 without one trains and checks text only)."""
    return has_vision(hf_config) and (hf_config["model_type"] not in OPTIONAL_TOWER or
                                      os.path.isfile(os.path.join(model_dir,
                                                                  "preprocessor_config.json")))


def hf_class(model_type: str, role: str):
    """transformers' `role` class ("config", "tower" or "model") of a vision-language family."""
    names = TOWERS[model_type]
    module = "transformers" if role == "config" else f"transformers.models.{names.module}"
    return getattr(importlib.import_module(module), getattr(names, role))


def full_hf_config(hf_config: Any):
    """The transformers config object of a config.json dict (or the object itself)."""
    cls = hf_class(hf_config["model_type"] if isinstance(hf_config, Mapping) else
                   hf_config.model_type, "config")
    return hf_config if isinstance(hf_config, cls) else cls.from_dict(dict(hf_config))


def vision_tower(hf_config: Mapping[str, Any]) -> torch.nn.Module:
    """The family's transformers vision transformer + merger, built from config.json's
    `vision_config` (random init; the bridge loads its weights)."""
    model_type = hf_config["model_type"]
    vision = dict(hf_config.get("vision_config") or {})
    config = hf_class(model_type, "config")(vision_config=vision)
    return hf_class(model_type, "tower")._from_config(config.vision_config)


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """M-RoPE whose frequency channels cycle t, h, w, t, h, w... (channel 3k+1 takes the height
    position and 3k+2 the width position while k < the axis's section; all others the temporal
    one), as Qwen3.5's `recomposition_frequencies`; megatron-core's own takes contiguous
    sections (Qwen2-VL)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: List[int],
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
        """[s, b, 1, 2 * dim] rotary angles of [3, b, s] position ids."""
        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = seq[..., None].float() * self.inv_freq   # [3, b, s, dim]
        mixed = freqs[0].clone()
        for axis in (1, 2):
            channels = slice(axis, 3 * mrope_section[axis], 3)
            mixed[..., channels] = freqs[axis, ..., channels]
        emb = torch.cat((mixed, mixed), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        cp_group = self.cp_group if cp_group is None else cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


def mrope_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[3, b, s] M-RoPE ids from [3, b, s] (unchanged) or text-only [b, s] ids."""
    if position_ids.dim() == 2:
        return position_ids.unsqueeze(0).expand(3, -1, -1)
    return position_ids


class VisionGPTModel(GPTModel):
    """GPTModel plus the HF vision tower on the first stage (see the module docstring)."""

    tower_cache: Optional[TowerCache] = None   # set inside frozen_tower_cache (vision_cache.py)

    def __init__(self, config, *, hf_config: Mapping[str, Any], dtype: torch.dtype, **kwargs):
        super().__init__(config, **kwargs)
        if hf_config["model_type"] in INTERLEAVED_MROPE:
            self.rotary_pos_emb = InterleavedMRoPE(
                kv_channels=config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_base=kwargs.get("rotary_base", 10000),
                seq_len_interpolation_factor=kwargs.get("seq_len_interpolation_factor"))
        self.image_token_id = int(hf_config["image_token_id"])
        if self.pre_process:
            setattr(self, VISUAL, vision_tower(hf_config).to(dtype))
            # the embedding leaves the sequence whole: images are merged, then scattered here
            self.embedding.scatter_to_sequence_parallel = False
            self.embedding.reduce_scatter_embeddings = False
            self.embedding.word_embeddings.reduce_scatter_embeddings = False
            self._hook_deepstack(len(deepstack_indexes(hf_config)))

    def _hook_deepstack(self, count: int) -> None:
        """Register `_add_deepstack` on the first `count` decoder layers (all on this chunk)."""
        layers = {layer.layer_number: layer for layer in self.decoder.layers}
        missing = [n for n in range(1, count + 1) if n not in layers]
        if missing:
            raise UserError(f"the vision tower's deepstack features go into decoder layers "
                            f"1..{count}, which must all be on the first pipeline stage (its "
                            f"first model chunk); it holds {len(layers)} layer(s): use a smaller "
                            "--pipeline_model_parallel_size (or no virtual pipeline)")
        for k in range(count):
            layers[k + 1].register_forward_hook(functools.partial(_add_deepstack, k),
                                                with_kwargs=True)

    def embed(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
              image_grid_thw: Optional[torch.Tensor],
              prompt_mask: Optional[torch.Tensor] = None,
              image_keys: Optional[Sequence] = None) -> Tuple[torch.Tensor, Dict]:
        """[s, b, h] token embeddings with the image embeddings merged in at the image tokens
        (of the prompts only, where `prompt_mask` [b, s] says which positions those are: a
        completion may sample the image token id, which then is a plain token, as in vLLM and
        transformers' generation); sequence-parallel scattered when SP is on. Also the
        decoder's deepstack arguments (`deepstack_context`; {} without). With a `tower_cache`
        and `image_keys` (one per image), the tower's outputs come from the cache."""
        emb = self.embedding(input_ids=input_ids, position_ids=None)
        deepstack = {}
        if pixel_values is not None:
            mask = input_ids == self.image_token_id   # [b, s]
            if prompt_mask is not None:
                mask &= prompt_mask.to(mask.device)
            visual = getattr(self, VISUAL)
            if self.tower_cache is not None and image_keys is not None:
                image, features = self.tower_cache.outputs(visual, pixel_values, image_grid_thw,
                                                           image_keys)
            else:
                image, features = tower_outputs(visual, pixel_values, image_grid_thw)
            if int(mask.sum()) != image.shape[0]:
                raise UserError(f"the batch has {int(mask.sum())} image tokens but its images "
                                f"give {image.shape[0]} embeddings")
            # row by row (images are in row order), as transformers' [b, s, h] masked_scatter
            emb = emb.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), image.to(emb.dtype))
            emb = emb.transpose(0, 1).contiguous()
            if features:
                deepstack = self.deepstack_context(mask, features, emb.dtype)
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
            if self.config.clone_scatter_output_in_embedding:
                emb = emb.clone()
        return emb, deepstack

    def deepstack_context(self, mask: torch.Tensor, features: Sequence[torch.Tensor],
                          dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """The decoder's `context` [layers, n, h] (the deepstack features of the n image tokens
        of this rank's sequence chunk, in [s, b] order) and `context_mask` [s / tp, b] (where
        those tokens are) of an image-token mask [b, s] and the tower's features (each [N, h],
        in [b, s] order, as transformers adds them)."""
        order = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
        order[mask] = torch.arange(int(mask.sum()), device=mask.device)
        mask, order = mask.t(), order.t()          # [s, b], as the hidden states
        stacked = torch.stack(list(features)).to(dtype)   # [layers, N, h]
        if self.config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            chunk = mask.shape[0] // tp
            mask, order = (t[rank * chunk:(rank + 1) * chunk] for t in (mask, order))
            # each rank's gradient covers its chunk's rows only: summed over TP in the backward
            # pass, the replicated tower gets the whole gradient on every rank (as the
            # embeddings' sequence-parallel scatter does for the merged image embeddings)
            stacked = tensor_parallel.copy_to_tensor_model_parallel_region(stacked)
        return {"context": stacked[:, order[mask]], "context_mask": mask.contiguous()}

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: Optional[torch.Tensor] = None,
                image_grid_thw: Optional[torch.Tensor] = None,
                prompt_mask: Optional[torch.Tensor] = None, image_keys: Optional[Sequence] = None,
                extra_block_kwargs=None, **kwargs):
        if self.pre_process and decoder_input is None:
            decoder_input, deepstack = self.embed(input_ids, pixel_values, image_grid_thw,
                                                  prompt_mask, image_keys)
            if deepstack:
                extra_block_kwargs = {**(extra_block_kwargs or {}), **deepstack}
        return super().forward(input_ids, mrope_positions(position_ids), attention_mask,
                               decoder_input, *args, extra_block_kwargs=extra_block_kwargs,
                               **kwargs)


def deepstack_indexes(hf_config: Mapping[str, Any]) -> List[int]:
    """The vision tower's blocks whose features deepstack adds to the decoder (Qwen3-VL; []
    for towers without)."""
    return list((hf_config.get("vision_config") or {}).get("deepstack_visual_indexes") or [])


def _add_deepstack(k: int, layer, args, kwargs, output):
    """Forward hook of decoder layer k (0-based): add the k-th deepstack features at the image
    tokens (the decoder's `context` / `context_mask`, see the module docstring), as
    transformers' `_deepstack_process` does after its layer k."""
    features, mask = kwargs.get("context"), kwargs.get("context_mask")
    if features is None:
        return output
    hidden, context = output
    hidden = hidden.index_put((mask,), hidden[mask] + features[k].to(hidden.dtype))
    return hidden, context


def vision_part(name: str) -> str:
    """"aligner" (`visual.merger.*`, and Qwen3-VL's deepstack mergers
    `visual.deepstack_merger_list.*`, as ms-swift), "vit" (the rest of `visual.*`) or "llm"
    (anything else), for a Megatron parameter name or an exported hub tensor name (`visual.`,
    or Qwen3-VL's and Qwen3.5's `model.visual.`)."""
    if name.startswith(f"model.{VISUAL}."):
        name = name[len("model."):]
    if name.startswith((f"{VISUAL}.merger.", f"{VISUAL}.deepstack_merger_list.")):
        return "aligner"
    return "vit" if name.startswith(f"{VISUAL}.") else "llm"


def freeze(model: torch.nn.Module, *, freeze_llm: bool, freeze_vit: bool,
           freeze_aligner: bool) -> None:
    """ms-swift's full-training freezing of a vision-language model: `visual.merger` is the
    aligner, the rest of `visual` the ViT, every other parameter the language model."""
    frozen = {"aligner": freeze_aligner, "vit": freeze_vit, "llm": freeze_llm}
    for name, param in model.named_parameters():
        if frozen[vision_part(name)]:
            param.requires_grad_(False)
