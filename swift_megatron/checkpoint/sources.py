"""What a checkpoint path on the command line holds, found from its files without loading any
weights: the base model's weights (`WeightsSource`) behind `--mcore_model`, and the LoRA adapter
(`AdapterSource`) behind `--adapters` / `--mcore_adapter`; `load_weights` then loads a
WeightsSource into a model of any layout.

    our model directory        DIR/swift_megatron.json (+ hf/, model/)   checkpoint/layout.py
    our save directory         SAVE/latest_checkpointed_iteration.txt + iter_*/swift_megatron.json
                               (its latest iteration)
    an ms-swift checkpoint     CKPT/latest_checkpointed_iteration.txt + iter_*/ (+ args.json)
                               checkpoint/ms_swift.py
    a PEFT adapter             adapter_config.json + adapter_model.safetensors

A LoRA checkpoint is never read as a full model (that would drop its adapter): ours holds the
adapter in DIR/adapter (PEFT) beside the base weights; ms-swift's holds only the adapter tensors
in its distributed checkpoint (converted by checkpoint/ms_swift_lora.py), and usually the same
adapter as PEFT files beside it (read first).
"""
import dataclasses
import json
import os
from typing import Optional

from swift_megatron.checkpoint import ms_swift
from swift_megatron.checkpoint.integrity import check_checkpoint_files
from swift_megatron.errors import UserError

OUR_META = "swift_megatron.json"   # checkpoint/layout.py's META (that module imports torch)
OUR_ADAPTER = "adapter"            # a LoRA training checkpoint's PEFT adapter subdirectory


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Where the base model's weights are read from, and what describes them."""

    kind: str                          # "hf" (safetensors), "mcore" (ours), "ms_swift"
    path: str
    hf_files: Optional[str] = None     # config.json + tokenizer files, when the source has them
    dtype: Optional[str] = None        # the dtype the weights were saved in, when recorded
    base_model: Optional[str] = None   # ms-swift: args.json's model (a path or a hub id)

    def describe(self) -> str:
        names = {"hf": "HF checkpoint", "mcore": "Megatron model directory",
                 "ms_swift": "ms-swift Megatron checkpoint"}
        return f"{names[self.kind]} {self.path}"


@dataclasses.dataclass(frozen=True)
class AdapterSource:
    """A LoRA adapter and the base model it belongs to, as far as it says. The adapter is a PEFT
    directory, or (`ms_swift`) the LoRA tensors of an ms-swift distributed checkpoint, converted
    to one by checkpoint/ms_swift_lora.py before loading."""

    peft_dir: Optional[str]
    base: Optional[WeightsSource] = None   # our LoRA checkpoint: its own base weights
    base_model: Optional[str] = None       # else the base it names (args.json, adapter_config)
    ms_swift: Optional[str] = None         # an ms-swift checkpoint holding the LoRA tensors

    @property
    def path(self) -> str:
        return self.peft_dir or self.ms_swift

    def describe(self) -> str:
        if self.peft_dir:
            return f"PEFT adapter {self.peft_dir}"
        return f"ms-swift LoRA checkpoint {self.ms_swift} (converted to PEFT at load time)"


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _has_peft_files(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, n)) for n in ms_swift.ADAPTER_FILES)


def our_model_dir(path: str) -> Optional[str]:
    """Our model directory at `path`, or the latest iteration of our save directory there."""
    if os.path.isfile(os.path.join(path, OUR_META)):
        return path
    latest = os.path.join(path, ms_swift.LATEST)
    if not os.path.isfile(latest) or ms_swift.is_ms_swift_checkpoint(path):
        return None
    iteration = os.path.join(path, f"iter_{ms_swift.read_latest(path):07d}")
    return iteration if os.path.isfile(os.path.join(iteration, OUR_META)) else None


def _our_source(directory: str, flag: str) -> WeightsSource:
    if flag != "--load":   # --load's directory is checked as the checkpoint to resume
        check_checkpoint_files(directory, f"the checkpoint is damaged: point {flag} at another "
                                          f"one, or write it again")
    meta = _read_json(os.path.join(directory, OUR_META))
    if meta.get("train_type") == "lora_llm":   # adapters and a fully trained vision tower
        raise UserError(f"{flag} {directory} is a --train_type lora_llm checkpoint, which only "
                        "--load resumes; its weights are in the merged HF copy beside it "
                        "(checkpoint-<step>-merged, or final_hf): pass that as --model")
    return WeightsSource("mcore", directory, os.path.join(directory, "hf"), meta.get("dtype"))


def _ms_swift_source(checkpoint: "ms_swift.MsSwiftCheckpoint", flag: str) -> WeightsSource:
    """Its distributed checkpoint; or, when that holds no weights, the safetensors beside it."""
    hf_files = checkpoint.directory if checkpoint.has_hf_weights else None
    if checkpoint.has_sharded_weights:
        return WeightsSource("ms_swift", checkpoint.directory, hf_files, checkpoint.torch_dtype,
                             checkpoint.base_model)
    if hf_files:
        return WeightsSource("hf", hf_files, hf_files, checkpoint.torch_dtype,
                             checkpoint.base_model)
    raise UserError(f"{flag} {checkpoint.directory}: {os.path.basename(checkpoint.iter_dir)}/ "
                    "holds no weights (no metadata.json) and there are no safetensors beside it")


def mcore_source(path: str, flag: str = "--mcore_model") -> WeightsSource:
    """The full model behind `path` (ours or ms-swift's); UserError for a LoRA checkpoint or
    anything else."""
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: no such directory")
    ours = our_model_dir(path)
    if ours is not None:
        if os.path.isdir(os.path.join(ours, OUR_ADAPTER)):
            raise UserError(f"{flag} {path} is a LoRA checkpoint (it holds {OUR_ADAPTER}/): pass "
                            "it as --mcore_adapter, merged with --merge_lora true or written as "
                            "an adapter with --merge_lora false")
        return _our_source(ours, flag)
    if ms_swift.is_ms_swift_checkpoint(path):
        checkpoint = ms_swift.read_ms_swift_checkpoint(path)
        if checkpoint.tuner_type != "full":
            raise UserError(f"{flag} {path} is an ms-swift {checkpoint.tuner_type} checkpoint (it "
                            "holds adapters): pass it as --mcore_adapter with the base model as "
                            "--model")
        return _ms_swift_source(checkpoint, flag)
    raise UserError(f"{flag} {path} is not a swift-megatron model directory (no {OUR_META}) nor an "
                    f"ms-swift Megatron checkpoint (no {ms_swift.LATEST}); create one with "
                    "`megatron export --to_mcore true` or `megatron rlhf --save`")


def _named_base(peft_dir: str) -> Optional[str]:
    """The base model an adapter names: ms-swift's args.json beside it (or in its parent), else
    adapter_config.json's base_model_name_or_path."""
    for directory in (peft_dir, os.path.dirname(os.path.abspath(peft_dir))):
        args_path = os.path.join(directory, ms_swift.ARGS)
        if os.path.isfile(args_path):
            args = _read_json(args_path)
            model_dir = args.get("model_dir")
            return model_dir if model_dir and os.path.isdir(model_dir) else args.get("model")
    config = _read_json(os.path.join(peft_dir, ms_swift.ADAPTER_FILES[0]))
    return config.get("base_model_name_or_path") or None


def adapter_source(path: str, flag: str) -> AdapterSource:
    """The adapter behind `path`: a PEFT directory (ms-swift checkpoints keep one beside their
    distributed checkpoint) or our LoRA checkpoint. UserError for anything else."""
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: no such directory")
    if _has_peft_files(path):
        return AdapterSource(path, base_model=_named_base(path))
    ours = our_model_dir(path)
    if ours is not None:
        adapter = os.path.join(ours, OUR_ADAPTER)
        if not os.path.isdir(adapter):
            raise UserError(f"{flag} {path}: no {OUR_ADAPTER}/ directory (is this a checkpoint "
                            "of a --train_type lora run?)")
        return AdapterSource(adapter, base=_our_source(ours, flag),
                             base_model=_named_base(adapter))
    if ms_swift.is_ms_swift_checkpoint(path):
        checkpoint = ms_swift.read_ms_swift_checkpoint(path)
        if checkpoint.has_peft_adapter:
            return AdapterSource(checkpoint.directory, base_model=checkpoint.base_model)
        if checkpoint.tuner_type == "full":
            raise UserError(f"{flag} {path} is an ms-swift full-model checkpoint, not an adapter: "
                            "pass it as --mcore_model")
        if not checkpoint.has_sharded_weights:
            raise UserError(f"{flag} {path}: an ms-swift LoRA checkpoint with neither its PEFT "
                            f"files ({', '.join(ms_swift.ADAPTER_FILES)}) nor LoRA tensors in "
                            f"{os.path.basename(checkpoint.iter_dir)}/")
        return AdapterSource(None, base_model=checkpoint.base_model,
                             ms_swift=checkpoint.directory)
    raise UserError(f"{flag} {path}: not a PEFT adapter ({', '.join(ms_swift.ADAPTER_FILES)}) nor "
                    "a LoRA checkpoint")


def peft_dir_of(adapter: AdapterSource, hf_config: dict, tmp_dir: str) -> str:
    """A PEFT directory holding `adapter`: its own, or an ms-swift adapter kept in its
    distributed checkpoint converted under `tmp_dir` (each process its own copy: no shared file
    system needed)."""
    if adapter.peft_dir:
        return adapter.peft_dir
    from swift_megatron.checkpoint.ms_swift_lora import write_peft_adapter

    peft_dir = os.path.join(tmp_dir, "adapter")
    write_peft_adapter(ms_swift.read_ms_swift_checkpoint(adapter.ms_swift), hf_config, peft_dir)
    return peft_dir


def load_weights(chunks, source: WeightsSource, bridge) -> None:
    """Load the base weights `source` describes into this rank's model chunks, in any
    TP/PP/EP layout: HF safetensors through `bridge` (swift_megatron.bridge.Bridge of the model),
    our model directory, or an ms-swift checkpoint. Collective."""
    from swift_megatron.checkpoint.layout import load_model_dir

    if source.kind == "hf":
        bridge.load(chunks, source.path)
    elif source.kind == "ms_swift":
        ms_swift.load_ms_swift_model(chunks, source.path, bridge)
    else:
        load_model_dir(chunks, source.path)
