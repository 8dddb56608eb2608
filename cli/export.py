"""`megatron export`: HF -> Megatron (--to_mcore), Megatron -> HF (--to_hf), LoRA merge
(--merge_lora with --adapters or --mcore_adapter), and the HF vs Megatron precision check
(--test_convert_precision).

Parses the flags, checks inputs and output before anything heavy (swift_megatron.export.prepare),
relaunches under torchrun when NPROC_PER_NODE is set, then runs swift_megatron.export.run.
"""
from swift_megatron.arguments.commands import ExportCommandArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.launch import planned_world_size, relaunch, torchrun_argv

DESCRIPTION = ("Convert checkpoints between Hugging Face and Megatron-core (any TP/PP/EP layout) "
               "and check the conversion's precision. Launch several processes with "
               "NPROC_PER_NODE=N.")


def main(argv) -> int:
    args = parse_command(ExportCommandArguments, argv, prog="megatron export",
                         description=DESCRIPTION)
    from swift_megatron import export

    inputs = export.prepare(args, planned_world_size())
    if inputs.hf_dir and inputs.hf_dir != args.model.model:  # a downloaded hub id
        argv = [*argv, "--model", inputs.hf_dir]
    cmd = torchrun_argv("export", argv)
    if cmd:
        return relaunch(cmd)
    export.run(args, inputs)
    return 0
