"""Multi-turn (agentic) rollouts: schedulers, gym environments, the token-in token-out rollout
loop. docs/multi_turn.md is the user guide.

    from swift_megatron.rollout.multi_turn import build_scheduler, run_episodes
    scheduler = build_scheduler("calculator", max_turns=3, tokenizer=tok, args=flat)
    trajectories = run_episodes(engine, tok, scheduler, prompts, sampling, seeds, settings)

protocol.py: Episode, Turn, MultiTurnScheduler, Env; tokens.py: messages -> appended token ids;
runner.py: the loop and its metrics; gym.py: the gym scheduler; builtin.py: `calculator`,
`gym_scheduler`, `grid_world`.
"""
import inspect
from typing import Any, Callable, Optional

from swift_megatron.errors import UserError
from swift_megatron.rollout.multi_turn import builtin  # noqa: F401  (registers the built-ins)
from swift_megatron.rollout.multi_turn.protocol import (Env, Episode, MultiTurnScheduler, Turn,
                                                        resolve)
from swift_megatron.rollout.multi_turn.runner import (LIMIT_SCOPES, MultiTurnSettings, Trajectory,
                                                      multi_turn_metrics, run_episodes)
from swift_megatron.rollout.plugin_registry import GYM_ENVS, SCHEDULERS


def _registrar(registry, name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        registry.register(name, cls, inspect.getsourcefile(cls) or cls.__module__)
        return cls
    return register


def register_scheduler(name: str) -> Callable[[type], type]:
    """Class decorator for plugin files: `@register_scheduler("my_tool")` makes a
    MultiTurnScheduler subclass available as --multi_turn_scheduler my_tool."""
    return _registrar(SCHEDULERS, name)


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator for plugin files: `@register_env("my_env")` makes an Env subclass
    available as --gym_env my_env."""
    return _registrar(GYM_ENVS, name)


def build_scheduler(name: str, *, max_turns: Optional[int], tokenizer: Any, args: Any = None
                    ) -> MultiTurnScheduler:
    """The scheduler registered as `name` (UserError naming --multi_turn_scheduler if none),
    constructed with max_turns, tokenizer and args (every flag as an attribute); ms-swift
    scheduler classes are wrapped (compat/ms_swift/scheduler.py)."""
    cls = SCHEDULERS.lookup(name)
    if not issubclass(cls, MultiTurnScheduler):
        from swift_megatron.compat.ms_swift.scheduler import MsSwiftScheduler, is_ms_swift_scheduler

        if not is_ms_swift_scheduler(cls):
            raise UserError(f"--multi_turn_scheduler {name}: {cls.__name__} is neither a "
                            "MultiTurnScheduler (swift_megatron.rollout.multi_turn) nor an "
                            "ms-swift one")
        return MsSwiftScheduler.build(cls, max_turns, tokenizer, args)
    return cls(max_turns=max_turns, tokenizer=tokenizer, args=args)


__all__ = ["Env", "Episode", "LIMIT_SCOPES", "MultiTurnScheduler", "MultiTurnSettings",
           "Trajectory", "Turn", "build_scheduler", "multi_turn_metrics", "register_env",
           "register_scheduler", "resolve", "run_episodes"]
