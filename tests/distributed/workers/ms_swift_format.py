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


CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
           "distrib_optim_sharding_type": "dp_reshardable"}  # ms-swift's sharded-state metadata


def write_ms_swift_checkpoint(model, hf_dir: str, out_dir: str, state, *, dtype_name: str,
                              per_layer: bool = False) -> None:
    """OUT/{args.json, latest_checkpointed_iteration.txt, iter_0000001/} (collective).
    `per_layer`: layers stored as `decoder.layers.<i>.` (megatron does so for models whose layers
    differ, e.g. with moe_layer_freq) instead of stacked."""
    sharded = model.sharded_state_dict(metadata=dict(CONTENT, non_homogeneous_layers=per_layer))
    _write(sharded, out_dir, state, _args_json(hf_dir, state, dtype_name))


def _write(sharded: dict, out_dir: str, state, args: dict) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    _fake_swift_module()
    iter_dir = os.path.join(out_dir, "iter_0000001")
    if state.rank == 0:
        os.makedirs(iter_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": sharded, **_common_state(args, state)}, iter_dir,
                            content_metadata=CONTENT)
    if state.rank == 0:
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(args, f, indent=2)
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.barrier()


# ---- LoRA checkpoints -----------------------------------------------------------------------

class _PeftReader:
    """The bridge mappings' reader interface over a PEFT adapter's full tensors (its B matrices
    stand where the mappings read weights)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return list(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        tensor = self.tensors[name]
        return tensor if dim is None else tensor.narrow(dim, start, stop - start)


# megatron module -> (bridge mapping class of lora_B, HF projections, lora_A split over TP)
_ATTENTION = {
    "self_attention.linear_qkv": ("QKV", ("self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj"), False),
    "self_attention.linear_proj": ("Replicated", ("self_attn.o_proj",), True),
}
_MLP = {
    "mlp.linear_fc1": ("GateUp", ("mlp.gate_proj", "mlp.up_proj"), False),
    "mlp.linear_fc2": ("Replicated", ("mlp.down_proj",), True),
}
_EXPERTS = {  # one adapter per expert; ms-swift's LoRA has no expert TP
    "mlp.experts.experts.linear_fc1": ("GateUp", ("mlp.experts.{e}.gate_proj",
                                                  "mlp.experts.{e}.up_proj"), False),
    "mlp.experts.experts.linear_fc2": ("Replicated", ("mlp.experts.{e}.down_proj",), False),
}


def _lora_tensors(peft: dict, hf: list, mapping: str, split_a: bool, shard, dims):
    """This rank's (A, B) of one megatron linear: A shared by its projections (split along its
    columns for a row-parallel linear), B's rows as this TP rank holds them."""
    from swift_megatron.bridge import mapping as m

    reader = _PeftReader({n: t for n, t in peft.items()})
    a = peft[f"{hf[0]}.lora_A.weight"]
    if split_a:
        a = m.RowParallel("", "").load(reader, [f"{hf[0]}.lora_A.weight"], shard, dims)
    b = getattr(m, mapping)("", "").load(reader, [f"{n}.lora_B.weight" for n in hf], shard, dims)
    return a, b


def _sharded(key, tensor, offsets, split_axis, shard, dp_rank):
    """A ShardedTensor of this rank's part: split along `split_axis` over `shard`, or replicated."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    split = () if split_axis is None else ((split_axis, shard.rank, shard.size),)
    replica = (0, shard.rank if split_axis is None else 0, dp_rank)
    return ShardedTensor.from_rank_offsets(key, tensor.contiguous(), *offsets, *split,
                                           replica_id=replica, prepend_axis_num=len(offsets))


def _add_module(sharded, peft, module, spec, offsets, shard, dp_rank, dims, **names):
    mapping, projections, split_a = spec
    hf = [p.format(**names) for p in projections]
    a, b = _lora_tensors(peft, hf, mapping, split_a, shard, dims)
    key = f"decoder.layers.{module}.lora_%s.default.weight"
    axis = len(offsets)  # the first axis after the layer (and expert) axes
    sharded[f"{hf[0]}.A"] = _sharded(key % "A", a, offsets, axis + 1 if split_a else None, shard,
                                     dp_rank)
    sharded[f"{hf[0]}.B"] = _sharded(key % "B", b, offsets, None if split_a else axis, shard,
                                     dp_rank)


def ms_swift_lora_state(peft: dict, hf_config: dict, state) -> dict:
    """The sharded LoRA tensors as ms-swift saves them (keys
    `decoder.layers.<module>.lora_A.default.weight`, layers stacked, routed experts on a second
    axis): `peft` holds full HF-layout tensors {"model.layers.0.self_attn.q_proj.lora_A.weight":
    ...} whose q/k/v (gate/up) share one A, as ms-swift's fused adapters must. PP = 1; experts
    with ETP = 1."""
    from megatron.core import parallel_state as mpu

    from swift_megatron.bridge.mapping import Dims, Shard

    layers, experts = hf_config["num_hidden_layers"], hf_config.get("num_experts") or 0
    dims = Dims(hf_config["num_attention_heads"], hf_config["num_key_value_heads"],
                hf_config["head_dim"], 0, 0)
    shard, sharded = Shard(state.tp_rank, state.tp), {}
    local = experts // state.ep
    for layer in range(layers):
        prefix, offsets = f"model.layers.{layer}.", ((0, layer, layers),)
        for module, spec in {**_ATTENTION, **({} if experts else _MLP)}.items():
            spec = (spec[0], tuple(prefix + p for p in spec[1]), spec[2])
            _add_module(sharded, peft, module, spec, offsets, shard, state.dp_rank, dims)
        for e in range(mpu.get_expert_model_parallel_rank() * local,
                       (mpu.get_expert_model_parallel_rank() + 1) * local):
            for module, spec in _EXPERTS.items():
                spec = (spec[0], tuple(prefix + p for p in spec[1]), spec[2])
                _add_module(sharded, peft, module, spec, (*offsets, (1, e, experts)), Shard(),
                            mpu.get_expert_data_parallel_rank(), dims, e=e)
    return sharded


def write_ms_swift_lora_checkpoint(peft_dir: str, hf_dir: str, out_dir: str, state) -> None:
    """A LoRA run's ms-swift checkpoint of the adapter in `peft_dir`: only its tensors in the
    distributed checkpoint (no PEFT files beside it), args.json with tuner_type lora."""
    from safetensors.torch import load_file

    from swift_megatron.model.config import load_hf_config

    peft = {k[len("base_model.model."):]: t
            for k, t in load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items()}
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        config = json.load(f)
    lora = dict(tuner_type="lora", lora_rank=config["r"], lora_alpha=config["lora_alpha"],
                lora_dropout=0.05, target_modules=["all-linear"], use_rslora=False)
    _write(ms_swift_lora_state(peft, load_hf_config(hf_dir), state), out_dir, state,
           dict(_args_json(hf_dir, state, "float32"), **lora))
