"""The `args` object ms-swift hands to reward classes (`orms[name](args=args)`): one flat object
with every flag of the run as an attribute (`args.max_completion_length`, `args.num_generations`,
...), built from our argument groups."""
from types import SimpleNamespace
from typing import Any


def flat_args(args: Any) -> SimpleNamespace:
    """Every attribute of every group of `args` (e.g. RlhfArguments: model, data, grpo, ...) on
    one namespace. ValueError when two groups define the same name (flag names are unique)."""
    flat = {}
    for group_name, group in vars(args).items():
        for name, value in vars(group).items():
            if name in flat:
                raise ValueError(f"flag {name!r} is defined by two argument groups "
                                 f"(the second is {group_name!r})")
            flat[name] = value
    return SimpleNamespace(**flat)
