"""ms-swift's reward base classes (`swift.rewards.ORM`, `AsyncORM`) for plugin files.

A plugin subclasses one, defines `__call__(self, completions, **kwargs)` and registers the class
with `orms["name"] = MyReward`. swift-megatron creates it once as `MyReward(args=...)`, where
`args` exposes every flag of the run as an attribute (as ms-swift's arguments object does), and
calls it once per rollout batch; AsyncORM's `__call__` is a coroutine, awaited together with the
other asynchronous rewards (swift_megatron/rewards/registry.py `compute_rewards`).
"""
from typing import Any, List, Optional

from swift_megatron.errors import UserError


def _not_defined(instance: Any, base: str) -> UserError:
    name = type(instance).__name__
    return UserError(f"reward class {name} subclasses {base} but does not define "
                     f"__call__(self, completions, **kwargs)")


class ORM:
    """Base class of a synchronous outcome reward: `__call__` returns one float (or None) per
    completion."""

    def __init__(self, args: Optional[Any] = None, **kwargs):
        self.args = args

    def __call__(self, completions: List[str], **kwargs) -> List[Optional[float]]:
        raise _not_defined(self, "ORM")


class AsyncORM:
    """Base class of an asynchronous outcome reward (network calls, sandboxes): `__call__` is
    `async def` and returns one float (or None) per completion."""

    def __init__(self, args: Optional[Any] = None, **kwargs):
        self.args = args

    async def __call__(self, completions: List[str], **kwargs) -> List[Optional[float]]:
        raise _not_defined(self, "AsyncORM")
