"""Qwen2.5-VL on megatron-core: the language model is a GPTModel with M-RoPE, the vision tower
plus merger is transformers' own module, held by the first pipeline stage and replicated over
tensor parallelism (every TP rank computes it in full).

`VisionGPTModel.forward` takes, besides GPTModel's arguments, `pixel_values` and
`image_grid_thw` (as the Qwen2-VL image processor returns them). On the first stage it embeds
the tokens without the sequence-parallel scatter, writes the merged image embeddings over the
`image_token_id` positions of the prompts (as transformers' `masked_scatter`), then scatters the
sequence. `position_ids` are the 3-D M-RoPE ids [3, b, s]; 2-D ids [b, s] (text-only batches,
where the three axes are equal) are broadcast to the three axes.
"""
from typing import Any, Mapping, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from swift_megatron.errors import UserError

VISION_TYPES = ("qwen2_5_vl",)
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "prompt_mask")  # micro-batch entries it takes
VISUAL = "visual"  # the vision tower's attribute (and parameter prefix) in the Megatron model


def vision_tower(hf_config: Mapping[str, Any]) -> torch.nn.Module:
    """transformers' Qwen2.5-VL vision transformer + merger, built from config.json's
    `vision_config` (random init; the bridge loads its weights)."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import \
        Qwen2_5_VisionTransformerPretrainedModel

    vision = Qwen2_5_VLConfig(vision_config=dict(hf_config.get("vision_config") or {})).vision_config
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision)


def mrope_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[3, b, s] M-RoPE ids from [3, b, s] (unchanged) or text-only [b, s] ids."""
    if position_ids.dim() == 2:
        return position_ids.unsqueeze(0).expand(3, -1, -1)
    return position_ids


class VisionGPTModel(GPTModel):
    """GPTModel plus the HF vision tower on the first stage (see the module docstring)."""

    def __init__(self, config, *, hf_config: Mapping[str, Any], dtype: torch.dtype, **kwargs):
        super().__init__(config, **kwargs)
        self.image_token_id = int(hf_config["image_token_id"])
        if self.pre_process:
            setattr(self, VISUAL, vision_tower(hf_config).to(dtype))
            # the embedding leaves the sequence whole: images are merged, then scattered here
            self.embedding.scatter_to_sequence_parallel = False
            self.embedding.reduce_scatter_embeddings = False
            self.embedding.word_embeddings.reduce_scatter_embeddings = False

    def embed(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
              image_grid_thw: Optional[torch.Tensor],
              prompt_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[s, b, h] token embeddings with the image embeddings merged in at the image tokens
        (of the prompts only, where `prompt_mask` [b, s] says which positions those are: a
        completion may sample the image token id, which then is a plain token, as in vLLM and
        transformers' generation); sequence-parallel scattered when SP is on."""
        emb = self.embedding(input_ids=input_ids, position_ids=None)
        if pixel_values is not None:
            mask = input_ids == self.image_token_id   # [b, s]
            if prompt_mask is not None:
                mask &= prompt_mask.to(mask.device)
            visual = getattr(self, VISUAL)
            image = visual(pixel_values.to(visual.dtype), grid_thw=image_grid_thw).pooler_output
            if int(mask.sum()) != image.shape[0]:
                raise UserError(f"the batch has {int(mask.sum())} image tokens but its images "
                                f"give {image.shape[0]} embeddings")
            # row by row (images are in row order), as transformers' [b, s, h] masked_scatter
            emb = emb.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), image.to(emb.dtype))
            emb = emb.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
            if self.config.clone_scatter_output_in_embedding:
                emb = emb.clone()
        return emb

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: Optional[torch.Tensor] = None,
                image_grid_thw: Optional[torch.Tensor] = None,
                prompt_mask: Optional[torch.Tensor] = None, **kwargs):
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, prompt_mask)
        return super().forward(input_ids, mrope_positions(position_ids), attention_mask,
                               decoder_input, *args, **kwargs)


def vision_part(name: str) -> str:
    """"aligner" (`visual.merger.*`), "vit" (the rest of `visual.*`) or "llm" (anything else),
    for a Megatron parameter name or an exported hub tensor name (both use `visual.`)."""
    if name.startswith(f"{VISUAL}.merger."):
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
