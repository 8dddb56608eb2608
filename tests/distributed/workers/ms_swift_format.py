"""Write a checkpoint in ms-swift's Megatron format from a tiny HF checkpoint, the way ms-swift's
`save_mcore_checkpoint` does, with megatron-core's own modules (Transformer Engine is not
installable here):

    OUT/args.json, OUT/latest_checkpointed_iteration.txt ("1"),
    OUT/iter_0000001/  dist_checkpointing.save({'model': GPTModel.sharded_state_dict(),
                       'args', 'iteration', 'checkpoint_version', 'rng_state'}, ...)

The GPTModel uses megatron-core's local layer spec, whose `sharded_state_dict_keys_map` stores
the pre-attention norm as `self_attention.linear_qkv.layer_norm_weight` (TE's fused
TELayerNormColumnParallelLinear) and, in dense layers, the pre-MLP norm as
`mlp.linear_fc1.layer_norm_weight`. TE's MoE layer keeps `pre_mlp_layernorm` (a TENorm): the map
of MoE layers is cut to the attention norm. Experts are SequentialMLP, whose sharded keys and
shapes are TEGroupedMLP's (megatron-core documents them as interchangeable). The vocabulary is
padded to a multiple of 128 x TP as ms-swift's make_vocab_size_divisible_by does, and the
common state pickles an object of a `swift.*` class, so that reading common.pt without ms-swift
installed fails as it does with a real checkpoint. Collective.
"""
import dataclasses
import json
import os
import sys
import types

VOCAB_MULTIPLE = 128  # megatron's make_vocab_size_divisible_by default, used by ms-swift
ATTENTION_NORM_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}


class SwiftArguments:
    """Stands for ms-swift's argument classes inside common.pt (module `swift.megatron.arguments`)."""

    def __init__(self, **values):
        self.__dict__.update(values)


SwiftArguments.__module__ = "swift.megatron.arguments"


def _fake_swift_module():
    """Make SwiftArguments picklable here; a reader without it cannot unpickle common.pt."""
    for name in ("swift", "swift.megatron", "swift.megatron.arguments"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["swift.megatron.arguments"].SwiftArguments = SwiftArguments


def _layer_spec(shape):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    if shape.num_experts:
        spec.submodules.sharded_state_dict_keys_map = dict(ATTENTION_NORM_MAP)
    return spec


def build_ms_swift_model(hf_dir: str, dtype, tp: int):
    """(GPTModel with ms-swift's key naming and vocab padding, its Bridge), HF weights loaded."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    from swift_megatron.bridge import Bridge
    from swift_megatron.model.config import load_hf_config, model_shape, transformer_config

    hf = load_hf_config(hf_dir)
    multiple = VOCAB_MULTIPLE * tp
    shape = model_shape(hf, tp=tp)
    shape = dataclasses.replace(shape, padded_vocab_size=-(-shape.vocab_size // multiple) * multiple)
    config = transformer_config(
        hf, dtype=dtype, tp=tp, pp=mpu.get_pipeline_model_parallel_world_size(),
        ep=mpu.get_expert_model_parallel_world_size(),
        etp=mpu.get_expert_tensor_parallel_world_size(), use_cpu_initialization=True)
    model = GPTModel(config, transformer_layer_spec=_layer_spec(shape),
                     vocab_size=shape.padded_vocab_size,
                     max_sequence_length=shape.max_position_embeddings,
                     pre_process=mpu.is_pipeline_first_stage(),
                     post_process=mpu.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=shape.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=shape.rope_theta)
    bridge = Bridge(hf, shape, config)
    bridge.load(model, hf_dir)
    return model, bridge


def _args_json(hf_dir: str, state, dtype_name: str) -> dict:
    """The args.json keys the loader reads, and the layout it was saved with."""
    return dict(model=hf_dir, model_dir=hf_dir, model_type="qwen3", torch_dtype=dtype_name,
                tuner_type="full", tensor_model_parallel_size=state.tp,
                pipeline_model_parallel_size=state.pp, expert_model_parallel_size=state.ep,
                expert_tensor_parallel_size=state.etp, save_safetensors=False)


def _common_state(args: dict, state) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng = ShardedObject("rng_state", [{"torch_rng_state": torch.get_rng_state()}],
                        (state.pp, state.tp), (state.pp_rank, state.tp_rank),
                        replica_id=state.dp_rank)
    return {"args": SwiftArguments(**args), "checkpoint_version": 3.0, "iteration": 1,
            "rng_state": rng}


def write_ms_swift_checkpoint(model, hf_dir: str, out_dir: str, state, *, dtype_name: str,
                              per_layer: bool = False) -> None:
    """OUT/{args.json, latest_checkpointed_iteration.txt, iter_0000001/} (collective).
    `per_layer`: layers stored as `decoder.layers.<i>.` (megatron does so for models whose layers
    differ, e.g. with moe_layer_freq) instead of stacked."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    _fake_swift_module()
    args = _args_json(hf_dir, state, dtype_name)
    iter_dir = os.path.join(out_dir, "iter_0000001")
    if state.rank == 0:
        os.makedirs(iter_dir, exist_ok=True)
    dist.barrier()
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
               "distrib_optim_sharding_type": "dp_reshardable"}
    sharded = model.sharded_state_dict(metadata=dict(content, non_homogeneous_layers=per_layer))
    dist_checkpointing.save({"model": sharded, **_common_state(args, state)}, iter_dir,
                            content_metadata=content)
    if state.rank == 0:
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(args, f, indent=2)
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.barrier()
