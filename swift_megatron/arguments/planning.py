"""Automatic planning flags: --auto_parallel chooses the parallel layout, recomputation,
offloads and micro-batch token budget (swift_megatron/planning/); ms-swift has no such flag."""
from dataclasses import dataclass
from typing import Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError


@dataclass
class PlanningArguments:
    """Automatic planning"""

    auto_parallel: bool = arg(False, "Choose the tensor, pipeline, expert and context parallel "
                              "sizes, sequence parallelism, recomputation, reference and "
                              "optimizer offload and --max_tokens_per_micro_batch that fit the "
                              "GPUs with a 10% margin and are fastest by a cost model; flags you "
                              "set stay as given. Prints the plan and an `auto_parallel flags:` "
                              "line to paste; with --dry_run true it only prints, otherwise the "
                              "run uses the plan. Needs only config.json (no weights).")
    gpu_memory_gib: Optional[float] = arg(None, "With --auto_parallel: memory of one GPU in GiB, "
                                          "to plan for GPUs other than this machine's (or on a "
                                          "machine without one). Default: the visible GPU's.")

    def __post_init__(self):
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            raise UserError(f"--gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
