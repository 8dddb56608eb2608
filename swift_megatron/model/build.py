"""Build the GPTModel of one pipeline stage (or its model chunks, with the interleaved
schedule) from an HF config (random init; the bridge loads weights). `build_model` (one chunk)
and `build_chunks` are what the trainer, the exporter and the tests call."""
from typing import Mapping, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from swift_megatron.model import compat  # noqa: F401  (megatron-core fixes, applied on import)
from swift_megatron.model.config import ModelShape, model_shape, transformer_config
from swift_megatron.model.layout import PipelineSplit
from swift_megatron.model.moe_dispatch import use_device_dispatch
from swift_megatron.model.spec import block_spec, hybrid_block_spec
from swift_megatron.model.vision import VisionGPTModel, has_vision


def _apply_llama3_rope_scaling(model: GPTModel, rope: Mapping) -> None:
    """Scale RoPE frequencies with the checkpoint's own llama3 parameters (GPTModel's
    `rope_scaling` flag hard-codes low/high freq factors 1/4 and an 8192 original context)."""
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=rope["factor"], low_freq_factor=rope.get("low_freq_factor", 1.0),
        high_freq_factor=rope.get("high_freq_factor", 4.0),
        original_max_position_embeddings=rope.get("original_max_position_embeddings", 8192))


def build_gpt(config, shape: ModelShape, pre_process: Optional[bool] = None,
              post_process: Optional[bool] = None, vp_stage: Optional[int] = None,
              hf_config: Optional[Mapping] = None) -> GPTModel:
    """The GPTModel of this rank's pipeline stage, or of its model chunk `vp_stage` with the
    interleaved schedule (its layers, plus embedding / head when first / last). Parameters are
    on the CPU when config.use_cpu_initialization, else on the GPU. Vision-language families
    (model/vision.py) need `hf_config` (the vision tower's config and image token); without
    it, or for a config without `vision_config`, the model is text-only."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    first, layers = pipeline_split(config).chunk(parallel_state.get_pipeline_model_parallel_rank(),
                                                 vp_stage or 0)
    if shape.is_hybrid:
        spec = hybrid_block_spec(shape.layer_types[first:first + layers], shape.num_experts,
                                 config.moe_grouped_gemm)
    else:
        spec = block_spec(layers, shape.qk_layernorm, shape.num_experts, config.moe_grouped_gemm)
    cls, extra = GPTModel, dict(position_embedding_type="rope")
    if hf_config is not None and has_vision(hf_config):
        cls, extra = VisionGPTModel, dict(position_embedding_type="mrope", hf_config=hf_config,
                                          dtype=config.params_dtype)
    model = cls(
        config, transformer_layer_spec=spec, rotary_percent=shape.rotary_percent,
        vocab_size=shape.padded_vocab_size, max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        rotary_base=shape.rope_theta, parallel_output=True, vp_stage=vp_stage, **extra)
    if shape.rope_scaling:
        _apply_llama3_rope_scaling(model, shape.rope_scaling)
    use_device_dispatch(model)
    if not config.use_cpu_initialization:
        model.cuda(torch.cuda.current_device())
    return model


def pipeline_split(config) -> PipelineSplit:
    """How a TransformerConfig's layers split over its pipeline stages and model chunks."""
    return PipelineSplit(config.num_layers, config.pipeline_model_parallel_size,
                         config.virtual_pipeline_model_parallel_size or 1,
                         config.num_layers_in_first_pipeline_stage,
                         config.num_layers_in_last_pipeline_stage)


def _zeros(tensor: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.zeros_(tensor)


def build_model(hf_config: Mapping, dtype: torch.dtype, device: torch.device, *,
                sequence_parallel: bool = False, model_type: Optional[str] = None,
                random_init: bool = True, **config_overrides):
    """(GPTModel of this stage, TransformerConfig, ModelShape) for the current parallel state
    (one model chunk per stage; `build_chunks` for the interleaved schedule).

    random_init=False fills the weights with zeros instead (fast: the caller loads a checkpoint
    next). The initialisers run either way: megatron-core 0.16.1 sets the tensor-parallel
    attributes of its linear weights (tensor_model_parallel, partition_dim) only there, and
    without them grad-norm and clipping silently count only TP rank 0's shards."""
    chunks, cfg, shape = build_chunks(hf_config, dtype, device, sequence_parallel=sequence_parallel,
                                      model_type=model_type, random_init=random_init,
                                      **config_overrides)
    if len(chunks) != 1:
        raise ValueError("build_model builds one model chunk per stage; the interleaved "
                         "pipeline needs build_chunks")
    return chunks[0], cfg, shape


def build_chunks(hf_config: Mapping, dtype: torch.dtype, device: torch.device, *,
                 sequence_parallel: bool = False, model_type: Optional[str] = None,
                 random_init: bool = True, **config_overrides):
    """([GPTModel of each model chunk of this stage], TransformerConfig, ModelShape): one chunk,
    or one per virtual stage with --virtual_pipeline_model_parallel_size (build_model's
    docstring says what random_init does)."""
    if not random_init:
        config_overrides = dict(config_overrides, init_method=_zeros,
                                output_layer_init_method=_zeros)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    cfg = transformer_config(
        hf_config, dtype=dtype, tp=tp, pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(), vpp=vpp,
        sequence_parallel=sequence_parallel, use_cpu_initialization=device.type == "cpu",
        model_type=model_type, **config_overrides)
    shape = model_shape(hf_config, tp=tp, model_type=model_type)
    if vpp == 1:
        return [build_gpt(cfg, shape, hf_config=hf_config)], cfg, shape
    return [build_gpt(cfg, shape, vp_stage=stage, hf_config=hf_config)
            for stage in range(vpp)], cfg, shape
