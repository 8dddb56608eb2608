"""`megatron export`: HF -> Megatron (--to_mcore), Megatron -> HF (--to_hf), LoRA merge, and the
HF vs Megatron precision check (--test_convert_precision)."""
from swift_megatron.arguments.commands import ExportCommandArguments
from swift_megatron.arguments.parser import parse_command

DESCRIPTION = "Convert checkpoints between Hugging Face and Megatron-core, merge LoRA adapters."


def main(argv) -> int:
    parse_command(ExportCommandArguments, argv, prog="megatron export", description=DESCRIPTION)
    return 0
