"""The `megatron export` conversion flow, in every process of the layout: load the base model
(HF through the bridge, or a Megatron model directory) with its adapter, then write the output
form the command asks for (a Megatron model directory, merged or with the adapter kept; an HF
checkpoint through the bridge's single export path; a PEFT adapter), then run the precision
check when asked. Collective.
"""
import time
from typing import TYPE_CHECKING

from swift_megatron.checkpoint.loaded_model import LoadedModel, load_mcore_model
from swift_megatron.export.inputs import ExportInputs
from swift_megatron.export.peft_forms import as_peft, save_model_dir, save_peft_dir
from swift_megatron.export.plan import OUTPUTS
from swift_megatron.export.precision import run_precision
from swift_megatron.logging import get_logger

if TYPE_CHECKING:
    import torch

    from swift_megatron.arguments.commands import ExportCommandArguments
    from swift_megatron.parallel.state import ParallelState

logger = get_logger(__name__)


def load_inputs(inputs: ExportInputs, dtype: "torch.dtype", state: "ParallelState") -> LoadedModel:
    """The base model of the command, with its adapter when there is one. Collective."""
    source = {"hf_dir" if inputs.base.kind == "hf" else "mcore_dir": inputs.base.path}
    adapter = inputs.adapter.peft_dir if inputs.adapter else None
    return load_mcore_model(inputs.hf_config, inputs.model_type, dtype, state,
                            adapter_dir=adapter, **source)


def write_output(args: "ExportCommandArguments", inputs: ExportInputs,
                 state: "ParallelState") -> None:
    """Load the base (+ adapter) and write what the command asks for. Megatron and PEFT outputs
    are loaded in the written dtype; an HF output is loaded in the source dtype (when supported)
    and converted by the bridge while writing. Collective."""
    from swift_megatron.lora import merge_and_unload
    from swift_megatron.model.config import DTYPES

    e, start = args.export, time.perf_counter()
    hf_from_source = inputs.output == "hf" and inputs.source_dtype in DTYPES
    load_dtype = inputs.source_dtype if hf_from_source else inputs.dtype
    loaded = load_inputs(inputs, DTYPES[load_dtype], state)
    if inputs.output == "mcore":
        if inputs.merge:
            merge_and_unload(loaded.model)
        kept = inputs.lora if inputs.adapter and not inputs.merge else None
        save_model_dir(loaded, e.output_dir, inputs.hf_files, state, lora=kept,
                       base_name=inputs.base_name)
    elif inputs.output == "peft":
        save_peft_dir(loaded, e.output_dir, inputs.base_name, inputs.lora, state)
    else:
        loaded.bridge.save_hf(loaded.model, e.output_dir, source_dir=inputs.hf_files,
                              dtype=DTYPES[inputs.dtype], max_shard_size=e.max_shard_size,
                              exist_ok=e.exist_ok,
                              passthrough_dir=inputs.base.hf_files if inputs.base.kind == "hf"
                              else inputs.model_dir)
    logger.info(f"wrote {OUTPUTS[inputs.output]} {e.output_dir} ({inputs.model_type}, "
                f"{inputs.dtype}, TP={state.tp} PP={state.pp} EP={state.ep} ETP={state.etp}) in "
                f"{time.perf_counter() - start:.1f} s")


def run(args: "ExportCommandArguments", inputs: ExportInputs) -> None:
    """Write and check what `args` ask for, in this process's share of the layout."""
    import tempfile

    from swift_megatron.parallel.state import ParallelState

    p = args.parallel
    state = ParallelState.initialize(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
        device=args.model.device, timeout_s=p.ddp_timeout, backend=p.ddp_backend,
        first_stage_layers=p.decoder_first_pipeline_num_layers,
        last_stage_layers=p.decoder_last_pipeline_num_layers)
    try:
        with tempfile.TemporaryDirectory(prefix="swift_megatron_export_") as tmp_dir:
            inputs = as_peft(inputs, tmp_dir)
            if inputs.output:
                write_output(args, inputs, state)
            if args.export.test_convert_precision:
                run_precision(args, inputs, state)
    finally:
        ParallelState.destroy()
