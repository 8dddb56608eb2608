"""`megatron demo`: the main job on an embedded tiny model and dataset (swift_megatron/demo)."""
from dataclasses import dataclass

from swift_megatron.arguments.fields import arg
from swift_megatron.arguments.parser import parse_command


@dataclass
class DemoArguments:
    """Demo"""

    output_dir: str = arg("demo_output", "Where the tiny model, dataset and run outputs go.")
    train_iters: int = arg(30, "GRPO optimizer steps.")


@dataclass
class DemoCommand:
    demo: DemoArguments


def main(argv) -> int:
    args = parse_command(DemoCommand, argv, prog="megatron demo",
                         description="Build a tiny model and dataset, then run the main job.")
    from swift_megatron.demo.run import run_demo

    run_demo(args.demo.output_dir, args.demo.train_iters)
    return 0
