"""ms-swift's base classes for gym environments (`swift.rollout.gym_env.Env`) and multi-turn
rollout schedulers (`swift.rollout.multi_turn.RolloutScheduler`, `MultiTurnScheduler`).

Plugins subclass them and register with `envs["name"] = MyEnv` / `multi_turns["name"] =
MyScheduler`; the classes land in swift_megatron/rollout/plugin_registry.py. The hooks a subclass
overrides (`reset`/`step`/`close`, `step`/`check_finished`, `on_trajectory_start`/`on_turn_end`)
keep ms-swift's signatures and defaults. swift-megatron's rollout loop drives those hooks
(compat/ms_swift/scheduler.py); `run`, ms-swift's own loop over an inference engine, is not
used and raises a UserError.
"""
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional, Tuple

from swift_megatron.compat.ms_swift.protocol import (ChatCompletionResponseChoice, Messages,
                                                     RequestConfig, RolloutInferRequest,
                                                     RolloutOutput)
from swift_megatron.errors import UserError


class Env(ABC):
    """A gym environment for multi-turn GRPO: `reset` returns (first observation, info, system
    prompt); `step` takes the conversation so far and returns (next observation, reward, done,
    info)."""

    def __init__(self, env_config: Dict[str, Any]):
        self.env_config = env_config

    @abstractmethod
    async def reset(self, config: RolloutInferRequest) -> Tuple[str, Dict[str, Any], str]:
        """Start an episode for the dataset row in `config.data_dict`."""

    @abstractmethod
    async def step(self, action: Messages) -> Tuple[str, float, bool, Dict[str, Any]]:
        """Apply the last assistant message of `action`."""

    @abstractmethod
    async def close(self) -> None:
        """Release the environment's resources."""


class RolloutScheduler(ABC):
    """Drives the rollout of one request; the base runs a single turn."""

    def __init__(self, infer_engine: Optional[Any] = None, max_turns: Optional[int] = None,
                 *args, **kwargs):
        self.infer_engine = infer_engine
        self.max_turns = max_turns
        self._tokenizer = kwargs.get("tokenizer")

    @property
    def engine(self) -> Optional[Any]:
        return self.infer_engine

    @property
    def tokenizer(self) -> Optional[Any]:
        """The tokenizer passed as `tokenizer=`, else the engine's."""
        if self._tokenizer is not None:
            return self._tokenizer
        return getattr(self.infer_engine, "tokenizer", None)

    async def on_trajectory_start(self, requests: List[RolloutInferRequest]) -> None:
        """Called once before the first turn; may edit `requests` in place."""

    async def on_turn_end(self, infer_request: RolloutInferRequest,
                          response_choice: ChatCompletionResponseChoice,
                          current_turn: int) -> Dict[str, Any]:
        """Called after each turn; may return {"done": bool, "rollout_infos": {...}}."""
        return {}

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig,
                  **kwargs) -> RolloutOutput:
        raise UserError(f"{type(self).__name__}.run: swift-megatron runs multi-turn rollouts "
                        f"itself and calls the scheduler's hooks (on_trajectory_start, "
                        f"on_turn_end, check_finished, step), not run()")


class MultiTurnScheduler(RolloutScheduler, ABC):
    """A multi-turn scheduler: override `step` (and optionally `check_finished`), or `run`."""

    def step(self, infer_request: RolloutInferRequest,
             response_choice: ChatCompletionResponseChoice, current_turn: int) -> Dict[str, Any]:
        """The next turn's request: {"infer_request": ..., optional "response_token_ids",
        "response_loss_mask", "rollout_logprobs", "rollout_infos"}."""
        raise NotImplementedError(f"{type(self).__name__} must implement step() or override run()")

    def check_finished(self, infer_request: RolloutInferRequest,
                       response_choice: ChatCompletionResponseChoice, current_turn: int) -> bool:
        """Stop when the answer hit the length limit or max_turns turns are done."""
        if response_choice.finish_reason == "length":
            return True
        return bool(self.max_turns) and current_turn >= self.max_turns
