"""Reading checkpoints written by ms-swift's Megatron mode (`swift`'s `megatron sft/rlhf/export`),
so that they load as `megatron export --mcore_model/--mcore_adapter` (and, wired by the trainer,
`megatron rlhf --mcore_model/--load`).

The format (ms-swift's `save_mcore_checkpoint`, megatron-core 0.16):

    CKPT/args.json                          ms-swift's arguments: model (hub id or path), model_dir
                                            (its local copy), torch_dtype, tuner_type (full|lora),
                                            lora_rank, lora_alpha, target_modules, ...; written
                                            beside the latest file (an iter_* directory finds it
                                            in its parent)
    CKPT/latest_checkpointed_iteration.txt  N
    CKPT/iter_000000N/                      a megatron distributed checkpoint (torch_dist):
                                            metadata.json, .metadata, __*_*.distcp, common.pt
    CKPT/*.safetensors, config.json, ...    with ms-swift's save_safetensors (its default) the
                                            same weights as an HF checkpoint, or for LoRA a PEFT
                                            adapter (adapter_config.json, adapter_model.safetensors)

The distributed checkpoint nests the model as {'model': GPTModel.sharded_state_dict(), 'args':
argparse.Namespace, 'iteration', 'checkpoint_version', optimizer, rng}. The tensors' storage
keys are megatron-core GPTModel names with the layers stacked on a leading axis
(`decoder.layers.self_attention.linear_qkv.weight` [L, qkv rows, hidden]; models whose layers
differ, e.g. dense and MoE layers mixed, store `decoder.layers.<i>.` per layer instead, and are
read so too) and the routed experts on a second one (`decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2 x ffn, hidden];
TEGroupedMLP and SequentialMLP write the same keys). ms-swift builds the Transformer Engine spec,
which fuses two norms into the linear that follows them; our spec keeps them as modules
(`NORM_NAMES`). Its vocabulary is padded to a multiple of 128 x TP, ours to a multiple of TP:
megatron loads embedding and output rows with a shape mismatch allowed.

common.pt (pickled argparse args, scheduler state) is never read: it may need ms-swift's own
classes to unpickle. Only the sharded tensors are loaded, in any TP/PP/EP layout, whatever the
layout they were saved with. A LoRA run's distributed checkpoint holds only the adapters
(`_filter_adapter_state_dict`): checkpoint/ms_swift_lora.py reads them (or the PEFT files beside).
"""
import dataclasses
import json
import os
import re
from typing import List, Optional, Sequence, Set

import torch

from swift_megatron.checkpoint.dist import stored_keys
from swift_megatron.errors import UserError

LATEST = "latest_checkpointed_iteration.txt"
ARGS = "args.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_LAYERS = r"^(decoder\.layers\.(?:\d+\.)?)"
# (our storage key, Transformer Engine's) for the norms TE fuses into the next linear. Dense
# layers fuse both; MoE layers keep pre_mlp_layernorm (a TENorm), so every key tries its own name
# first and TE's second.
NORM_NAMES = (
    (_LAYERS + r"input_layernorm\.", r"\1self_attention.linear_qkv.layer_norm_"),
    (_LAYERS + r"pre_mlp_layernorm\.", r"\1mlp.linear_fc1.layer_norm_"),
)


@dataclasses.dataclass(frozen=True)
class MsSwiftCheckpoint:
    """What an ms-swift checkpoint directory holds."""

    directory: str       # the directory of the latest file (and args.json)
    iter_dir: str        # its iter_XXXXXXX distributed checkpoint
    args: dict           # args.json ({} when absent)

    @property
    def tuner_type(self) -> str:
        return self.args.get("tuner_type") or self.args.get("train_type") or "full"

    @property
    def has_sharded_weights(self) -> bool:
        """Whether iter_* is a distributed checkpoint (ms-swift writes only common.pt there when
        it saves safetensors without optimizer state)."""
        return os.path.isfile(os.path.join(self.iter_dir, "metadata.json"))

    @property
    def has_hf_weights(self) -> bool:
        names = os.listdir(self.directory)
        return "config.json" in names and any(n.endswith(".safetensors") and n not in
                                              ADAPTER_FILES for n in names)

    @property
    def has_peft_adapter(self) -> bool:
        return all(os.path.isfile(os.path.join(self.directory, n)) for n in ADAPTER_FILES)

    @property
    def base_model(self) -> Optional[str]:
        """The HF base model of the run: args.json's model_dir when it exists here, else its
        model (a local directory or a hub id); None without args.json."""
        model_dir = self.args.get("model_dir")
        if model_dir and os.path.isdir(model_dir):
            return model_dir
        return self.args.get("model") or model_dir

    @property
    def torch_dtype(self) -> Optional[str]:
        dtype = self.args.get("torch_dtype")
        return dtype.replace("torch.", "") if isinstance(dtype, str) else None


def _latest_dir(path: str) -> Optional[str]:
    """The directory holding the latest file: `path` itself or, for an iter_* dir, its parent."""
    for directory in (path, os.path.dirname(os.path.abspath(path))):
        if os.path.isfile(os.path.join(directory, LATEST)):
            return directory
    return None


def is_ms_swift_checkpoint(path: str) -> bool:
    """A directory with latest_checkpointed_iteration.txt and iter_* subdirectories (or one of
    those iter_* directories) that is not one of our own save directories."""
    directory = _latest_dir(path)
    if directory is None:
        return False
    return any(re.fullmatch(r"iter_\d{7}", n) for n in os.listdir(directory)) and \
        not _is_our_save_dir(directory)


def _is_our_save_dir(directory: str) -> bool:
    from swift_megatron.checkpoint.layout import META

    return any(os.path.isfile(os.path.join(directory, n, META)) for n in os.listdir(directory)
               if n.startswith("iter_"))


def read_latest(directory: str) -> int:
    """The iteration `directory`/latest_checkpointed_iteration.txt names (Megatron-LM's file,
    written by ms-swift and by us); UserError naming the file when it holds anything else."""
    path = os.path.join(directory, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read it ({exc})") from None
    if not text.isdigit():
        raise UserError(f"{path}: expected an iteration number, got {text[:40]!r} (a damaged "
                        "file: write the number of the iter_* directory to resume from)")
    return int(text)


def _iteration_dir(directory: str, path: str) -> str:
    if re.fullmatch(r"iter_\d{7}", os.path.basename(os.path.normpath(path))):
        return os.path.abspath(path)
    text = str(read_latest(directory))
    iter_dir = os.path.join(directory, f"iter_{int(text):07d}")
    if not os.path.isdir(iter_dir):
        raise UserError(f"{directory}: {LATEST} names iteration {text}, but there is no "
                        f"{os.path.basename(iter_dir)}/")
    return iter_dir


def read_ms_swift_checkpoint(path: str) -> MsSwiftCheckpoint:
    """The checkpoint at `path` (the directory of the latest file, or one iter_* directory)."""
    directory = _latest_dir(path)
    if directory is None or not is_ms_swift_checkpoint(path):
        raise UserError(f"{path} is not an ms-swift Megatron checkpoint (no {LATEST} with "
                        "iter_*/ beside it)")
    args = {}
    if os.path.isfile(os.path.join(directory, ARGS)):
        with open(os.path.join(directory, ARGS)) as f:
            args = json.load(f)
    return MsSwiftCheckpoint(os.path.abspath(directory), _iteration_dir(directory, path), args)


# ---- loading the sharded tensors ------------------------------------------------------------

def candidate_keys(key: str) -> List[str]:
    """Our storage key, then the Transformer Engine name of the same tensor (if it differs)."""
    names = [key]
    for ours, theirs in NORM_NAMES:
        if re.match(ours, key):
            names.append(re.sub(ours, theirs, key))
    return names


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _rename(sharded: dict, available: Set[str]) -> List[str]:
    """Point every sharded tensor (and tensor factory) at the name the checkpoint stores it
    under; drop every ShardedObject (`_extra_state`: nothing for our modules) and the adapters
    of a LoRA model (they are not base weights). Returns the keys found under no name."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    missing = []
    for name, value in list(sharded.items()):
        if isinstance(value, ShardedObject) or _is_adapter(name):
            del sharded[name]
            continue
        found = next((k for k in candidate_keys(value.key) if k in available), None)
        if found is None:
            missing.append(value.key)
        else:
            value.key = found
    return missing


def _common_free_strategy():
    """megatron's common-state loader with common.pt left unread."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class ShardedOnly(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return {}

    return ShardedOnly()


def load_sharded_model(model: torch.nn.Module, iter_dir: str) -> None:
    """Load this stage's base weights from the distributed checkpoint `iter_dir` (ms-swift's or
    ours, any layout): storage keys mapped to the checkpoint's names, common.pt left unread,
    LoRA adapters already on the model left as they are. UserError naming the tensors the
    checkpoint lacks. Collective."""
    from megatron.core import dist_checkpointing

    from swift_megatron.model.wrappers import unwrap

    model = unwrap(model)
    available = stored_keys(iter_dir)
    per_layer = any(re.match(r"decoder\.layers\.\d+\.", key) for key in available)
    sharded = model.sharded_state_dict(metadata={"non_homogeneous_layers": per_layer})
    missing = _rename(sharded, available)
    if missing:
        shown = ", ".join(sorted(missing)[:4]) + (" ..." if len(missing) > 4 else "")
        raise UserError(f"{iter_dir}: no tensor {shown} (nor its Transformer Engine name); the "
                        f"checkpoint has e.g. {', '.join(sorted(available)[:4])}. Is it a "
                        "checkpoint of this model?")
    state = dist_checkpointing.load(sharded, iter_dir, common_strategy=_common_free_strategy())
    result = model.load_state_dict(state, strict=False)
    not_loaded = [k for k in result.missing_keys
                  if not (k.endswith("._extra_state") or _is_adapter(k))]
    if not_loaded or result.unexpected_keys:
        raise ValueError(f"weights not loaded from {iter_dir}: {not_loaded or result.unexpected_keys}")


def _has_gated_delta_net(model: torch.nn.Module) -> bool:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    return any(isinstance(m, GatedDeltaNet) for m in model.modules())


def load_ms_swift_model(chunks: Sequence[torch.nn.Module], path: str,
                        bridge=None) -> MsSwiftCheckpoint:
    """Load the full-model weights of the ms-swift checkpoint at `path` into this rank's model
    (one chunk: virtual pipeline stages are not supported), in any TP/PP/EP layout: from its
    distributed checkpoint, or, when ms-swift saved only safetensors, from those through
    `bridge` (swift_megatron.bridge.Bridge of the model). UserError for a LoRA checkpoint (its
    distributed checkpoint holds the adapters only: load the base model and the adapter) or a
    checkpoint without weights. Collective."""
    if len(chunks) != 1:
        raise UserError(f"{path}: loading an ms-swift checkpoint with "
                        "--virtual_pipeline_model_parallel_size is not supported; convert it "
                        "first (megatron export --to_mcore) and pass that directory")
    checkpoint = read_ms_swift_checkpoint(path)
    if checkpoint.has_sharded_weights and _has_gated_delta_net(chunks[0]):
        raise UserError(f"{path}: ms-swift Megatron checkpoints of Qwen3.5 (Gated DeltaNet) are "
                        "not supported (their layout differs); export it to HF with ms-swift and "
                        "start from that")
    if checkpoint.tuner_type != "full":
        raise UserError(f"{path}: a {checkpoint.tuner_type} checkpoint holds adapters, not a model;"
                        " pass it as --mcore_adapter (with the base model as --model)")
    if checkpoint.has_sharded_weights:
        load_sharded_model(chunks[0], checkpoint.iter_dir)
    elif checkpoint.has_hf_weights and bridge is not None:
        bridge.load(chunks[0], checkpoint.directory)
    else:
        raise UserError(f"{path}: {os.path.basename(checkpoint.iter_dir)}/ holds no weights "
                        "(no metadata.json) and there are no safetensors beside it")
    return checkpoint
