"""The `args` object ms-swift hands to reward classes (`orms[name](args=args)`): one flat object
with every flag of the run as an attribute (`args.max_completion_length`, `args.num_generations`,
...), built from our argument groups."""
import dataclasses
from types import SimpleNamespace
from typing import Any


def flat_args(args: Any) -> SimpleNamespace:
    """Every flag of every group of `args` (e.g. RlhfArguments: model, data, grpo, ...) on one
    namespace. ValueError when two groups define the same name (flag names are unique)."""
    flat = {}
    for group_field in dataclasses.fields(args):
        if not group_field.init:  # e.g. `explicit`, not a group
            continue
        group = getattr(args, group_field.name)
        for field in dataclasses.fields(group):
            if field.name in flat:
                raise ValueError(f"flag {field.name!r} is defined by two argument groups "
                                 f"(the second is {group_field.name!r})")
            flat[field.name] = getattr(group, field.name)
    return SimpleNamespace(**flat)
