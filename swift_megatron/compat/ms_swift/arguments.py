"""The `args` object ms-swift hands to reward classes (`orms[name](args=args)`): one flat object
with every flag of the run as an attribute (`args.max_completion_length`, `args.num_generations`,
...), built from our argument groups."""
from types import SimpleNamespace
from typing import Any


def flat_args(args: Any) -> SimpleNamespace:
    """Every flag of every group of a parsed command (e.g. RlhfArguments) on one namespace."""
    from swift_megatron.arguments.parser import flat_values

    return SimpleNamespace(**flat_values(args))
