"""Multi-turn (agentic) rollouts: schedulers, gym environments, the token-in token-out rollout
loop. docs/multi_turn.md is the user guide.

    from swift_megatron.rollout.multi_turn import build_scheduler, run_episodes
    scheduler = build_scheduler("calculator", max_turns=3, tokenizer=tok, args=flat)
    trajectories = run_episodes(engine, tok, scheduler, prompts, sampling, seeds, settings)

protocol.py: Episode, Turn, MultiTurnScheduler, Env; tokens.py: messages -> appended token ids;
runner.py: the loop and its metrics; gym.py: the gym scheduler; builtin.py: `calculator`,
`gym_scheduler`, `grid_world`.
"""
from typing import Any, Optional

from swift_megatron.rollout.multi_turn import builtin  # noqa: F401  (registers the built-ins)
from swift_megatron.rollout.multi_turn.protocol import (Env, Episode, MultiTurnScheduler, Turn,
                                                        resolve)
from swift_megatron.rollout.multi_turn.runner import (LIMIT_SCOPES, MultiTurnSettings, Trajectory,
                                                      multi_turn_metrics, run_episodes)
from swift_megatron.rollout.plugin_registry import SCHEDULERS


def build_scheduler(name: str, *, max_turns: Optional[int], tokenizer: Any, args: Any = None
                    ) -> MultiTurnScheduler:
    """The scheduler registered as `name` (UserError naming --multi_turn_scheduler if none),
    constructed with max_turns, tokenizer and args (every flag as an attribute)."""
    cls = SCHEDULERS.lookup(name)
    return cls(max_turns=max_turns, tokenizer=tokenizer, args=args)


__all__ = ["Env", "Episode", "LIMIT_SCOPES", "MultiTurnScheduler", "MultiTurnSettings",
           "Trajectory", "Turn", "build_scheduler", "multi_turn_metrics", "resolve",
           "run_episodes"]
