"""`--multi_turn_scheduler gym_scheduler`: one gym environment per episode.

The environment is `--gym_env` (or the row's `env_config["name"]`), registered by a plugin
file (`envs["name"] = MyEnv` through ms-swift's API, or `GYM_ENVS.register`) or built in
(builtin.py). `reset` replaces the prompt with the environment's system prompt and first
observation; after every model turn `step` gets the conversation and returns the next
observation (the next user message), the turn's reward and whether the episode is over.
"""
import copy
from typing import Any, Optional

from swift_megatron.errors import UserError
from swift_megatron.rollout.multi_turn.protocol import Episode, MultiTurnScheduler, Turn, resolve
from swift_megatron.rollout.plugin_registry import GYM_ENVS


class GymScheduler(MultiTurnScheduler):
    def __init__(self, max_turns: Optional[int] = None, tokenizer: Any = None, args: Any = None,
                 gym_env: Optional[str] = None, **kwargs: Any):
        super().__init__(max_turns, tokenizer, args, **kwargs)
        self.gym_env = gym_env if gym_env is not None else getattr(args, "gym_env", None)

    def start(self, episode: Episode) -> None:
        config = episode.env_config
        name = config.get("name") or self.gym_env
        if not name:
            raise UserError(f"gym_scheduler: dataset row {episode.prompt_id} names no "
                            "environment: pass --gym_env, or give the row an env_config with "
                            "a 'name'")
        env = GYM_ENVS.lookup(name)(config)
        episode.state["env"] = env
        observation, info, system = resolve(env.reset(episode))
        episode.messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": str(observation)}]
        episode.info.update(info or {})

    def step(self, episode: Episode, completion: str, turn: int) -> Turn:
        result = resolve(episode.state["env"].step(copy.deepcopy(episode.messages)))
        if not isinstance(result, tuple) or len(result) != 4:
            raise UserError(f"gym env {type(episode.state['env']).__name__}.step must return "
                            f"(observation, reward, done, info), got {result!r}")
        observation, reward, done, info = result
        return Turn(message={"role": "user", "content": str(observation)}, reward=float(reward),
                    done=bool(done), info=dict(info or {}))

    def close(self, episode: Episode) -> None:
        env = episode.state.pop("env", None)
        if env is not None:
            resolve(env.close())


def gym_reward(completions, rollout_infos, **kwargs):
    """The reward column of --use_gym_env: each episode's total environment reward."""
    return [float(info.get("total_reward", 0.0)) for info in rollout_infos]
