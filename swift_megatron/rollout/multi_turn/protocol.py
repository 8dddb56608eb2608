"""The multi-turn protocol: what a scheduler sees (an Episode) and answers (a Turn), and the
gym environment interface.

After every model turn the rollout loop (runner.py) calls `scheduler.step(episode, completion,
turn)`; the scheduler answers with a Turn: the next message(s) for the model (a user, tool or
environment message, rendered with the chat template and appended as tokens the model did not
generate) or `done`, plus this turn's reward. Schedulers keep per-episode state on the episode
(`episode.state`), so one scheduler object serves every episode.

    class Tool(MultiTurnScheduler):
        def step(self, episode, completion, turn):
            if "<call>" not in completion:
                return Turn(done=True)
            return Turn(message={"role": "tool", "content": run(completion)})

Environments (`Env`) keep ms-swift's interface, synchronous or `async`:
`reset(episode) -> (observation, info, system_prompt)`, `step(messages) -> (observation,
reward, done, info)`, `close()`. GymScheduler (gym.py) drives one per episode.
"""
import asyncio
import dataclasses
import inspect
import uuid
from typing import Any, Dict, List, Optional, Sequence, Union

Message = Dict[str, Any]


@dataclasses.dataclass
class Turn:
    """A scheduler's answer after a model turn.

    message: the next message for the model (a dict, or a list of dicts: e.g. a tool result then
    a user message); None with done=False also ends the episode. reward: this turn's reward
    (summed over turns into the episode's total). done: stop here. info: JSON-serialisable
    metadata, merged into the episode's `rollout_infos` (what reward functions receive)."""

    message: Union[Message, Sequence[Message], None] = None
    reward: float = 0.0
    done: bool = False
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def messages(self) -> List[Message]:
        if self.message is None:
            return []
        return [self.message] if isinstance(self.message, dict) else list(self.message)


class Episode:
    """One conversation being rolled out.

    messages: the chat so far (the dataset prompt's messages, or what `start` set, then one
    assistant message per model turn and the scheduler's messages between them); columns: the
    dataset row's other columns (ms-swift's `data_dict`); turn: model turns done; rewards: one
    per turn; info: `rollout_infos`; state: the scheduler's own per-episode storage;
    finish_reason / token_ids: of the last model turn ("stop" or "length", its token ids)."""

    def __init__(self, messages: Sequence[Message], columns: Optional[Dict[str, Any]] = None,
                 prompt_id: int = 0):
        self.messages: List[Message] = [dict(m) for m in messages]
        self.columns: Dict[str, Any] = dict(columns or {})
        self.prompt_id = prompt_id
        self.uuid = uuid.uuid4().hex
        self.turn = 0
        self.rewards: List[float] = []
        self.info: Dict[str, Any] = {}
        self.state: Dict[str, Any] = {}
        self.finish_reason: Optional[str] = None
        self.token_ids: List[int] = []

    @property
    def data_dict(self) -> Dict[str, Any]:
        """ms-swift's name for the dataset row's columns."""
        return self.columns

    @property
    def env_config(self) -> Dict[str, Any]:
        """The row's `env_config` column (gym environments), {} when absent."""
        config = self.columns.get("env_config")
        return dict(config) if isinstance(config, dict) else {}


class MultiTurnScheduler:
    """Base class of multi-turn schedulers: override `step`, and `start` / `close` when the
    episode needs setup (e.g. an initial observation) or teardown. `max_turns` (--max_turns) is
    enforced by the rollout loop; `tokenizer` and `args` (every flag, as attributes) are there
    for subclasses that need them. A turn cut at the length limit ends the episode (after its
    `step`, which still scores it) unless `stop_when_truncated` is False."""

    stop_when_truncated = True

    def __init__(self, max_turns: Optional[int] = None, tokenizer: Any = None, args: Any = None,
                 **kwargs: Any):
        self.max_turns, self.tokenizer, self.args = max_turns, tokenizer, args

    def start(self, episode: Episode) -> None:
        """Before the first turn: may replace `episode.messages` (the prompt is then rendered
        from them with the chat template)."""

    def step(self, episode: Episode, completion: str, turn: int) -> Turn:
        """After model turn `turn` (from 1): `completion` is its text (also the last message of
        `episode.messages`). Return the next message, or Turn(done=True)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def close(self, episode: Episode) -> None:
        """After the last turn (every episode, also truncated ones)."""


class Env:
    """A gym environment (ms-swift's interface; methods may be `async`). `env_config` is the
    dataset row's `env_config` column."""

    def __init__(self, env_config: Dict[str, Any]):
        self.env_config = env_config

    def reset(self, config: Episode):
        """-> (first observation: the first user message, info dict, system prompt or None)."""
        raise NotImplementedError

    def step(self, action: List[Message]):
        """`action`: the conversation so far, ending with the model's reply ->
        (next observation, reward, done, info dict)."""
        raise NotImplementedError

    def close(self):
        """Release resources."""


_LOOP: Optional[asyncio.AbstractEventLoop] = None


def resolve(value: Any) -> Any:
    """`value`, awaited when it is awaitable (async environments and schedulers), in one
    event loop kept for the process."""
    global _LOOP
    if not inspect.isawaitable(value):
        return value
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(value)
