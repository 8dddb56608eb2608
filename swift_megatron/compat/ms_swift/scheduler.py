"""ms-swift multi-turn schedulers (`multi_turns["name"] = MyScheduler`, subclasses of
`swift.rollout.multi_turn.MultiTurnScheduler`) run in swift-megatron's token-in, token-out
rollout loop (swift_megatron/rollout/multi_turn) through `MsSwiftScheduler`.

Per episode it keeps ms-swift's RolloutInferRequest (messages, data_dict, uuid) and calls the
hooks in ms-swift's order: `on_trajectory_start([request])` before the first turn; after each
model turn (the assistant message appended) `on_turn_end`, then `check_finished` (on_turn_end's
"done" wins), then, to continue, `step`, whose request's new trailing messages become the next
turn's tokens. `rollout_infos` are merged; a `total_reward` in them (ms-swift's gym convention)
is split into per-turn rewards. Not supported (UserError): overriding `run`, `step` returning
its own response_token_ids / response_loss_mask (the loop keeps the engine's tokens and masks
the scheduler's), and changing earlier messages (history rewriting, e.g. continuing the
assistant message, would need re-encoding the conversation).
"""
from typing import Any, Dict, Optional

from swift_megatron.compat.ms_swift.protocol import (ChatCompletionResponseChoice, ChatMessage,
                                                     RolloutInferRequest)
from swift_megatron.errors import UserError
from swift_megatron.rollout.multi_turn.protocol import (Episode, MultiTurnScheduler, Turn,
                                                        resolve)

BASE_CLASSES = ("RolloutScheduler", "MultiTurnScheduler")


def overrides_run(cls: type) -> bool:
    """Whether `cls` (an ms-swift scheduler class) defines its own `run`."""
    owner = next((c for c in cls.__mro__ if "run" in vars(c)), None)
    return owner is not None and owner.__name__ not in BASE_CLASSES


def is_ms_swift_scheduler(cls: type) -> bool:
    return any(c.__name__ in BASE_CLASSES for c in cls.__mro__) \
        and not issubclass(cls, MultiTurnScheduler)


class MsSwiftScheduler(MultiTurnScheduler):
    """An ms-swift scheduler object behind swift-megatron's protocol (module docstring)."""

    stop_when_truncated = False   # ms-swift's check_finished decides (its default stops)

    def __init__(self, inner: Any, max_turns: Optional[int] = None, tokenizer: Any = None,
                 args: Any = None):
        super().__init__(max_turns, tokenizer, args)
        self.inner, self.name = inner, type(inner).__name__

    @classmethod
    def build(cls, scheduler_cls: type, max_turns: Optional[int], tokenizer: Any,
              args: Any = None) -> "MsSwiftScheduler":
        if overrides_run(scheduler_cls):
            raise UserError(f"--multi_turn_scheduler: {scheduler_cls.__name__} overrides run(); "
                            "swift-megatron drives ms-swift schedulers through their hooks "
                            "(on_trajectory_start, on_turn_end, check_finished, step): move the "
                            "logic into those")
        inner = scheduler_cls(infer_engine=None, max_turns=max_turns, tokenizer=tokenizer)
        return cls(inner, max_turns, tokenizer, args)

    def start(self, episode: Episode) -> None:
        request = RolloutInferRequest(messages=[dict(m) for m in episode.messages],
                                      data_dict=episode.columns, uuid=episode.uuid)
        resolve(self.inner.on_trajectory_start([request]))
        episode.state["request"] = request
        episode.messages = [dict(m) for m in request.messages]

    def step(self, episode: Episode, completion: str, turn: int) -> Turn:
        request = episode.state["request"]
        request.messages = [dict(m) for m in episode.messages]
        choice = ChatCompletionResponseChoice(0, ChatMessage("assistant", completion),
                                              episode.finish_reason,
                                              token_ids=list(episode.token_ids))
        ended = resolve(self.inner.on_turn_end(request, choice, turn)) or {}
        infos: Dict[str, Any] = dict(ended.get("rollout_infos") or {})
        done = bool(ended["done"]) if "done" in ended else \
            bool(self.inner.check_finished(request, choice, turn))
        appended = []
        if not done:
            result = self.inner.step(request, choice, turn)
            appended = self._appended(episode, result)
            infos.update(result.get("rollout_infos") or {})
        reward = 0.0
        if "total_reward" in infos:   # the episode's total so far -> this turn's share
            reward = float(infos["total_reward"]) - sum(episode.rewards)
        return Turn(message=appended or None, reward=reward, done=done, info=infos)

    def _appended(self, episode: Episode, result: Any) -> list:
        """The messages `step` added after the conversation so far."""
        if not isinstance(result, dict) or "infer_request" not in result:
            raise UserError(f"{self.name}.step must return a dict with 'infer_request', got "
                            f"{type(result).__name__}")
        for key in ("response_token_ids", "response_loss_mask"):
            if result.get(key):
                raise UserError(f"{self.name}.step returned {key}: swift-megatron keeps the "
                                "engine's tokens and masks the scheduler's messages out of the "
                                "loss itself; return only infer_request (and rollout_infos)")
        request = result["infer_request"]
        messages = [dict(m) for m in request.messages]
        known = len(episode.messages)
        if messages[:known] != episode.messages:
            raise UserError(f"{self.name}.step changed earlier messages of the conversation; "
                            "token-in, token-out rollouts can only append messages (continuing "
                            "or rewriting the history is not supported)")
        episode.state["request"] = request
        return messages[known:]
