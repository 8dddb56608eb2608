"""The plan of a `megatron export` command, printed by --dry_run: what it reads, writes and
checks, in which layout."""
import os
from typing import TYPE_CHECKING

from swift_megatron.export.inputs import ExportInputs

if TYPE_CHECKING:
    from swift_megatron.arguments.commands import ExportCommandArguments

OUTPUTS = {"mcore": "Megatron model directory", "hf": "HF checkpoint", "peft": "PEFT adapter"}


def _adapter_line(inputs: ExportInputs) -> str:
    lora = inputs.lora
    what = {"mcore": "kept beside the weights (a LoRA checkpoint)", "hf": "merged",
            "peft": "written alone in PEFT format", None: "applied"}[inputs.output]
    if inputs.merge and inputs.output == "mcore":
        what = "merged"
    return (f"{inputs.adapter.describe()} (r={lora.r}, alpha={lora.lora_alpha:g}, "
            f"{', '.join(lora.projections())}): {what}")


def describe(args: "ExportCommandArguments", inputs: ExportInputs, world_size: int) -> str:
    """The plan of the command (--dry_run): what it reads, writes and checks, in which layout."""
    e, p = args.export, args.parallel
    unknown = "not checked (a hub id: downloaded at run time)"
    model = f"{inputs.model_type}, {inputs.source_dtype}" if inputs.hf_config else unknown
    rows = ["megatron export --dry_run: nothing was loaded, downloaded or written",
            f"  base weights      {inputs.base.describe()} ({model})",
            f"  config/tokenizer  {inputs.hf_files or unknown}"]
    if inputs.adapter:
        rows.append(f"  adapter           {_adapter_line(inputs)}")
    if inputs.output:
        replace = " (replacing it: --exist_ok true)" if os.path.exists(e.output_dir) else ""
        rows.append(f"  writes            {OUTPUTS[inputs.output]} ({inputs.dtype or 'source dtype'})"
                    f" at {e.output_dir}{replace}")
    dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    rows.append(f"  layout            TP={p.tensor_model_parallel_size} "
                f"PP={p.pipeline_model_parallel_size} EP={p.expert_model_parallel_size} "
                f"ETP={p.expert_tensor_parallel_size} on {world_size} process(es) (DP={dp})")
    if e.test_convert_precision:
        reference = e.output_dir if inputs.output == "hf" else inputs.reference
        rows.append(f"  precision check   {e.test_convert_dtype} logits vs transformers on "
                    f"{reference}, atol {e.test_convert_precision_atol:g}")
    return "\n".join(rows)
