"""`megatron export`: HF <-> Megatron (--to_mcore / --to_hf, from our model directories or
ms-swift Megatron checkpoints), LoRA adapters merged or kept (--adapters / --mcore_adapter,
--merge_lora), the HF vs Megatron precision check (--test_convert_precision) and --dry_run.

Parses the flags, checks inputs and output before anything heavy (swift_megatron.export.prepare),
prints the plan and stops with --dry_run, relaunches under torchrun when NPROC_PER_NODE is set,
then runs swift_megatron.export.run.
"""
from swift_megatron.arguments.commands import ExportCommandArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.launch import planned_world_size, relaunch, torchrun_argv

DESCRIPTION = ("Convert checkpoints between Hugging Face and Megatron-core (any TP/PP/EP layout; "
               "ms-swift Megatron checkpoints included), merge or convert LoRA adapters, and "
               "check the conversion's precision. Launch several processes with "
               "NPROC_PER_NODE=N.")


def main(argv) -> int:
    args = parse_command(ExportCommandArguments, argv, prog="megatron export",
                         description=DESCRIPTION)
    from swift_megatron import export

    world_size = planned_world_size()
    inputs = export.prepare(args, world_size)
    if args.export.dry_run:
        print(export.describe(args, inputs, world_size))
        return 0
    if inputs.model_dir and inputs.model_dir != args.model.model:  # a downloaded hub id
        argv = [*argv, "--model", inputs.model_dir]
    cmd = torchrun_argv("export", argv)
    if cmd:
        return relaunch(cmd)
    export.run(args, inputs)
    return 0
