"""`megatron plot OUTPUT_DIR [--metrics PATTERN ...]`: (re)write a run's report (plots,
summary.md, completions.html under OUTPUT_DIR/report) from its logging.jsonl, also while the run
is still going or after it was killed (swift_megatron/report)."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.arguments.parser import parse_command

DESCRIPTION = ("Write OUTPUT_DIR/report: PNG plots of the logged metrics, summary.md and "
               "completions.html, from OUTPUT_DIR/logging.jsonl (and completions.jsonl, "
               "args.json); with --metrics, only report/selected.png. Usage: megatron plot "
               "OUTPUT_DIR [--metrics PATTERN ...].")


@dataclass
class PlotArguments:
    """Plot"""

    output_dir: Optional[str] = arg(None, "The training run's --output_dir (also accepted as the "
                                          "first argument).")
    metrics: List[str] = arg([], "Draw only the metrics matching these patterns ('*' matches "
                                 "anything), e.g. 'reward/*' kl, into report/selected.png, "
                                 "leaving the rest of the report as it is. Default: the whole "
                                 "report.")
    smoothing: float = arg(0.6, "How much the curve drawn over the raw points is smoothed, in "
                                "[0, 1): a centred moving average of round(W / (1 - W)) points "
                                "each side (0.6: 2, 0.9: 9), shrinking at the ends so the curve "
                                "does not lag; 0 draws the raw curve.")


@dataclass
class PlotCommand:
    plot: PlotArguments


def main(argv) -> int:
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--output_dir", *argv]
    args = parse_command(PlotCommand, argv, prog="megatron plot", description=DESCRIPTION).plot
    from swift_megatron.errors import UserError
    from swift_megatron.report import write_report

    if not args.output_dir:
        raise UserError("megatron plot: give the run's directory: megatron plot OUTPUT_DIR")
    if not 0.0 <= args.smoothing < 1.0:
        raise UserError(f"--smoothing {args.smoothing}: must be in [0, 1)")
    report = write_report(args.output_dir, args.metrics, args.smoothing)
    for path in [*report.plots, report.completions, report.summary]:
        if path:
            print(path)
    return 0
