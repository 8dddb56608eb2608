"""What a `megatron export` command reads and writes, resolved and checked before any process is
launched or model built (`prepare`): the base weights (--mcore_model, --model, or the base an
adapter checkpoint holds or names), the config/tokenizer files, the adapter and its LoRA config,
the output form, the HF reference of the precision check, the parallel layout and world size.
Reads no weights; torch, megatron and transformers are imported inside the functions, so that
a missing path is rejected at once.
"""
import dataclasses
import os
from typing import TYPE_CHECKING, Optional

from swift_megatron.checkpoint.sources import (AdapterSource, WeightsSource, adapter_source,
                                               mcore_source)
from swift_megatron.errors import UserError

if TYPE_CHECKING:
    from swift_megatron.arguments.commands import ExportCommandArguments
    from swift_megatron.lora import LoraConfig


@dataclasses.dataclass(frozen=True)
class ExportInputs:
    """What `prepare` resolved: where the weights, config and adapter come from, what is written.
    In a dry run, a hub id is not downloaded: hf_files, hf_config, model_type and the dtypes are
    then None."""

    base: WeightsSource
    hf_files: Optional[str]        # config.json + tokenizer files of the model
    hf_config: Optional[dict]
    model_type: Optional[str]
    source_dtype: Optional[str]    # dtype name of the base weights
    dtype: Optional[str]           # dtype name of the written weights
    base_name: str                 # the base model as named to the user (adapter_config.json)
    adapter: Optional[AdapterSource] = None
    lora: Optional["LoraConfig"] = None
    merge: bool = False            # the adapter is merged into the weights
    output: Optional[str] = None   # "mcore" | "hf" | "peft"; None: precision check only
    reference: Optional[str] = None  # HF weights the precision check compares with
    model_dir: Optional[str] = None  # --model resolved to a local directory


def _is_hub_id(name: str) -> bool:
    return not os.path.exists(name) and name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _resolve_hf(args: "ExportCommandArguments", name: str, origin: str) -> Optional[str]:
    """A local HF directory for `name` (a path or a hub id, downloaded now); None for a hub id in
    a dry run. `origin` says where the name came from, for the error message."""
    from swift_megatron.model.hub import resolve_model_dir

    if args.export.dry_run and _is_hub_id(name):
        return None
    try:
        return resolve_model_dir(name, args.model.use_hf, args.model.model_revision)
    except UserError as exc:
        if origin == "--model":
            raise
        raise UserError(f"{origin} names the base model {name}: {exc}; pass --model") from None


def _base(args: "ExportCommandArguments", adapter: Optional[AdapterSource],
          model_dir: Optional[str]) -> WeightsSource:
    """--mcore_model, else --model, else the base the adapter checkpoint holds or names."""
    if args.export.mcore_model:
        return mcore_source(args.export.mcore_model)
    if args.model.model:
        return WeightsSource("hf", model_dir or args.model.model, model_dir)
    if adapter.base is not None:
        return adapter.base
    if adapter.base_model:
        found = _resolve_hf(args, adapter.base_model, f"adapter {args.adapter}")
        return WeightsSource("hf", found or adapter.base_model, found)
    raise UserError(f"adapter {args.adapter} does not name its base model (no args.json, no "
                    "base_model_name_or_path): pass --model")


def _hf_files(args: "ExportCommandArguments", base: WeightsSource,
              model_dir: Optional[str]) -> Optional[str]:
    """The config.json + tokenizer directory: the base's own, else --model's, else (ms-swift) the
    model its args.json names."""
    if base.hf_files or base.kind == "hf":
        return base.hf_files
    if args.model.model:
        return model_dir
    if base.base_model:
        return _resolve_hf(args, base.base_model, f"--mcore_model {base.path} (args.json)")
    raise UserError(f"--mcore_model {base.path}: no config.json beside it and no args.json naming "
                    "its model: pass --model (the HF model it was trained from)")


def _model_description(args: "ExportCommandArguments", base: WeightsSource,
                       hf_files: Optional[str]):
    """(hf_config, model_type, source dtype) from config.json; Nones when not available."""
    if hf_files is None:
        return None, None, base.dtype
    from swift_megatron.bridge.io import HFReader  # heavy imports after the cheap path checks
    from swift_megatron.model.config import load_hf_config, model_shape

    hf_config = load_hf_config(hf_files)
    shape = model_shape(hf_config, model_type=args.model.model_type)
    if base.kind == "hf":
        HFReader(base.path)  # fails now when the directory holds no safetensors checkpoint
    return hf_config, shape.model_type, base.dtype or shape.torch_dtype


def _adapter_config(adapter: Optional[AdapterSource]) -> Optional["LoraConfig"]:
    if adapter is None:
        return None
    from swift_megatron.lora import read_adapter_config  # imports megatron-core: only when needed

    if adapter.peft_dir:
        return read_adapter_config(adapter.peft_dir)
    from swift_megatron.checkpoint import ms_swift_lora
    from swift_megatron.checkpoint.ms_swift import read_ms_swift_checkpoint
    from swift_megatron.lora.peft_io import config_from_peft

    checkpoint = read_ms_swift_checkpoint(adapter.ms_swift)
    config = ms_swift_lora.peft_config(checkpoint, ms_swift_lora.adapter_keys(checkpoint))
    return config_from_peft(config, f"{adapter.ms_swift}/args.json")


def _output(args: "ExportCommandArguments", adapter: Optional[AdapterSource]) -> Optional[str]:
    e = args.export
    if e.to_mcore:
        return "mcore"
    if e.to_hf:
        return "peft" if adapter is not None and not e.merge_lora else "hf"
    return "hf" if e.merge_lora else None


def _reference(args: "ExportCommandArguments", base: WeightsSource, adapter, output,
               model_dir: Optional[str]) -> Optional[str]:
    """The HF weights the precision check compares with, before anything is written (for an HF
    output it is the output itself): the base's own, --model's, or the model it names."""
    if not args.export.test_convert_precision or output == "hf":
        return None
    if base.kind == "hf":
        return base.hf_files or base.path
    if model_dir or args.model.model:
        return model_dir or args.model.model
    name = base.base_model or (adapter.base_model if adapter else None)
    if name:
        return _resolve_hf(args, name, f"{base.describe()} (args.json)") or name
    raise UserError("--test_convert_precision true compares with an HF checkpoint of the model: "
                    "pass --model")


def _check_world(args: "ExportCommandArguments", world_size: int) -> None:
    p = args.parallel
    for name, degree in (("TP x PP", p.tensor_model_parallel_size * p.pipeline_model_parallel_size),
                         ("ETP x EP x PP", p.expert_tensor_parallel_size
                          * p.expert_model_parallel_size * p.pipeline_model_parallel_size)):
        if world_size % degree:
            raise UserError(f"{name} = {degree} needs a multiple of {degree} processes, this run "
                            f"has {world_size}: launch with NPROC_PER_NODE={degree}")


def _check_model(args: "ExportCommandArguments", inputs: "ExportInputs") -> None:
    from swift_megatron.model.config import DTYPES
    from swift_megatron.model.layout import check_layout

    if inputs.dtype is not None and inputs.dtype not in DTYPES:
        raise UserError(f"weights dtype {inputs.dtype!r} is not supported; pass --torch_dtype "
                        f"({', '.join(DTYPES)})")
    if inputs.hf_config is not None:
        p = args.parallel
        check_layout(inputs.hf_config, p.tensor_model_parallel_size,
                     p.pipeline_model_parallel_size, p.expert_model_parallel_size,
                     p.expert_tensor_parallel_size, **p.uneven_pipeline)


def _check_output(args: "ExportCommandArguments", inputs: ExportInputs) -> None:
    from swift_megatron.bridge.hf_checkpoint import check_output_dir

    e = args.export
    if inputs.output is None:
        return
    check_output_dir(e.output_dir, e.exist_ok)
    out = os.path.realpath(e.output_dir)
    adapter = inputs.adapter.path if inputs.adapter else None
    for source in (inputs.base.path, inputs.hf_files, adapter):
        if source and out == os.path.realpath(source):
            raise UserError(f"--output_dir {e.output_dir} is an input directory; choose another")


def prepare(args: "ExportCommandArguments", world_size: int) -> ExportInputs:
    """Resolve and check everything a user can get wrong, before any model is built: the input
    checkpoints, the model family, the adapter's config, the output directory, the parallel
    layout and world size. Reads no weights; downloads a hub id unless --dry_run."""
    flag = "--adapters" if args.lora.adapters else "--mcore_adapter"
    adapter = adapter_source(args.adapter, flag) if args.adapter else None
    model_dir = _resolve_hf(args, args.model.model, "--model") if args.model.model else None
    if model_dir and args.model.check_model:
        from swift_megatron.model.files import check_model_dir

        check_model_dir(model_dir)
    base = _base(args, adapter, model_dir)
    hf_files = _hf_files(args, base, model_dir)
    hf_config, model_type, source_dtype = _model_description(args, base, hf_files)
    output = _output(args, adapter)
    inputs = ExportInputs(
        base=base, hf_files=hf_files, hf_config=hf_config, model_type=model_type,
        source_dtype=source_dtype, dtype=args.model.torch_dtype or source_dtype,
        base_name=args.model.model or base.base_model or (adapter and adapter.base_model)
        or base.path, adapter=adapter,
        lora=_adapter_config(adapter),
        merge=bool(adapter and args.export.merge_lora), output=output,
        reference=_reference(args, base, adapter, output, model_dir), model_dir=model_dir)
    _check_model(args, inputs)
    _check_world(args, world_size)
    _check_output(args, inputs)
    return inputs
