"""HF <-> Megatron-core weights.

`Bridge(hf_config, shape, config)` binds a model family's mapping table (families/) to this
rank's place in the TP/PP/EP grid and offers:
- `load(model, hf_dir)`: stream HF safetensors into the sharded model (each rank reads its slices);
- `export(model)`: yield (hf_name, full tensor) on every rank, one tensor at a time: the single
  path for `megatron export --to_hf`, weight sync to rollout engines and LoRA merge;
`model` is this stage's model, or the list of its model chunks (the interleaved schedule);
- `save_hf(model, out_dir, source_dir)`: write a loadable HF checkpoint from `export`, plus the
  source checkpoint's tensors outside the Megatron model that the family passes through
  (Qwen3.5's MTP head), copied unchanged.
The mapping classes (mapping.py) own every scatter/gather; bridge/ never imports rollout/.
"""
from typing import Collection, Iterator, Optional, Tuple

import torch

from swift_megatron.bridge.export import build_plan, export_hf_weights
from swift_megatron.bridge.families import aliases_for, mappings_for, passthrough_for
from swift_megatron.bridge.hf_checkpoint import write_hf_checkpoint
from swift_megatron.bridge.load import load_hf_weights
from swift_megatron.bridge.mapping import Dims
from swift_megatron.bridge.position import RankPosition
from swift_megatron.model.config import ModelShape
from swift_megatron.model.wrappers import unwrap


def dims_of(config, shape: Optional[ModelShape] = None) -> Dims:
    """The dimensions the fused layouts need, from a TransformerConfig (vocab from `shape`;
    the Gated DeltaNet sizes are read by hybrid models' tables only)."""
    return Dims(num_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
                head_dim=config.kv_channels,
                vocab_size=shape.vocab_size if shape else 0,
                padded_vocab_size=shape.padded_vocab_size if shape else 0,
                linear_qk_dim=config.linear_key_head_dim * config.linear_num_key_heads,
                linear_v_dim=config.linear_value_head_dim * config.linear_num_value_heads,
                linear_v_heads=config.linear_num_value_heads)


class Bridge:
    def __init__(self, hf_config: dict, shape: ModelShape, config):
        self.hf_config = hf_config
        self.shape = shape
        self.mappings = mappings_for(shape.model_type, hf_config)
        self.passthrough = passthrough_for(shape.model_type)
        self.dims = dims_of(config, shape)
        self.pos = RankPosition.of_config(config, shape.num_experts or 0)
        self._plan = None

    def _parts(self, model):
        """(unwrapped chunk, its RankPosition) of each model chunk of this stage."""
        chunks = model if isinstance(model, (list, tuple)) else [model]
        return [(unwrap(c), self.pos.for_chunk(unwrap(c))) for c in chunks]

    def load(self, model, hf_dir: str) -> None:
        for chunk, pos in self._parts(model):
            load_hf_weights(chunk, hf_dir, self.mappings, self.dims, pos,
                            aliases_for(self.shape.model_type))

    def export(self, model, only: Optional[Collection[str]] = None
               ) -> Iterator[Tuple[str, torch.Tensor]]:
        """`only`: the global Megatron names to export (e.g. a LoRA adapter's modules trained
        in full), default all."""
        parts = self._parts(model)
        if self._plan is None:
            self._plan = build_plan(parts, self.mappings, self.dims)
        plan = self._plan if only is None else [i for i in self._plan if i.global_name in only]
        return export_hf_weights(parts, self.mappings, self.dims, plan)

    def num_exported(self, model) -> int:
        if self._plan is None:
            self._plan = build_plan(self._parts(model), self.mappings, self.dims)
        return sum(len(item.outputs) for item in self._plan)

    def save_hf(self, model, out_dir: str, source_dir: str, *,
                dtype: Optional[torch.dtype] = None, max_shard_size: str = "5GB",
                exist_ok: bool = False, passthrough_dir: Optional[str] = None) -> None:
        """Write an HF checkpoint: the exported tensors, the config and tokenizer files of
        `source_dir`, and the passthrough tensors of `passthrough_dir` (default `source_dir`)."""
        write_hf_checkpoint(self.export(model), out_dir, hf_config=self.hf_config,
                            source_dir=source_dir, dtype=dtype, max_shard_size=max_shard_size,
                            exist_ok=exist_ok, total=self.num_exported(model),
                            passthrough=self.passthrough, passthrough_dir=passthrough_dir)
