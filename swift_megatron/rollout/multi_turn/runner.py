"""The multi-turn rollout loop: every episode of a batch advances one model turn per engine
call, until its scheduler stops it, --max_turns is reached, a turn is truncated or the length
budget is spent.

Token-in, token-out: each turn the engine continues from the exact token ids of the episode so
far (prompt, its own earlier tokens, the scheduler's messages as tokens: tokens.py); the
trajectory is those ids after the prompt, with `loss_mask` 1 on the model's tokens and 0 on the
scheduler's. Budget (ms-swift's --completion_length_limit_scope): per_round, each model turn
gets up to max_completion_length tokens; total, the whole completion (model and scheduler
tokens) does; either way prompt + completion stays within max_length. Every engine call uses the
same sampling settings on every rank (colocate vLLM and server engines are collective) and each
turn's tokens are cut to the episode's budget afterwards; `keep_going(active)` lets the ranks
agree on whether another turn is needed (all reduce), so each rank makes the same calls.
"""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

from swift_megatron.data import Prompt, agent
from swift_megatron.errors import UserError
from swift_megatron.rollout.engine import Completion, RolloutEngine, SamplingConfig
from swift_megatron.rollout.multi_turn import tokens
from swift_megatron.rollout.multi_turn.protocol import (Episode, Message, MultiTurnScheduler,
                                                        Turn, resolve)

LIMIT_SCOPES = ("per_round", "total")


@dataclasses.dataclass(frozen=True)
class MultiTurnSettings:
    max_completion_length: int
    max_length: int                     # prompt + whole completion, tokens
    max_turns: Optional[int] = None     # None: no limit
    limit_scope: str = "per_round"      # per_round | total
    template_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    agent_template: Optional[str] = None   # --agent_template: hermes writes tool results itself


@dataclasses.dataclass
class Trajectory(Completion):
    """A multi-turn completion: token_ids / logprobs cover every token after the prompt (the
    scheduler's with logprob 0), loss_mask marks the model's; prompt_ids is the first prompt
    (the dataset's, or rendered from the messages the scheduler's `start` set); messages the
    whole chat; turn_token_ids the model's tokens per turn; rollout_infos the scheduler's
    metadata plus num_turns, step_rewards (one per turn) and total_reward (their sum)."""

    loss_mask: List[int] = dataclasses.field(default_factory=list)
    prompt_ids: List[int] = dataclasses.field(default_factory=list)
    messages: List[Message] = dataclasses.field(default_factory=list)
    turn_token_ids: List[List[int]] = dataclasses.field(default_factory=list)
    rollout_infos: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def last_answer(self) -> str:
        """The model's last turn as text (what ms-swift scores as the completion)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


class _Running:
    """One episode's growing token sequence."""

    def __init__(self, episode: Episode, prompt_ids: List[int], seed: int):
        self.episode, self.prompt_ids, self.seed = episode, prompt_ids, seed
        self.ids: List[int] = []
        self.logprobs: Optional[List[float]] = []
        self.mask: List[int] = []
        self.turns: List[List[int]] = []
        self.finish_reason: Optional[str] = None
        self.weight_version = 0

    def add(self, ids: Sequence[int], logprobs: Optional[Sequence[float]], mask: int) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs
        else:
            self.logprobs = None

    def room(self, settings: MultiTurnSettings, extra: int = 0) -> int:
        """Tokens the next model turn may still add (after `extra` more scheduler tokens)."""
        used = len(self.ids) + extra
        left = settings.max_length - len(self.prompt_ids) - used
        if settings.limit_scope == "total":
            left = min(left, settings.max_completion_length - used)
        return min(left, settings.max_completion_length)

    def trajectory(self) -> Trajectory:
        e = self.episode
        infos = {"num_turns": len(self.turns), "step_rewards": list(e.rewards),
                 "total_reward": float(sum(e.rewards)), **e.info}
        return Trajectory(self.ids, self.logprobs, self.finish_reason, self.weight_version,
                          loss_mask=self.mask, prompt_ids=self.prompt_ids, messages=e.messages,
                          turn_token_ids=self.turns, rollout_infos=infos)


def turn_seed(seed: int, turn: int) -> int:
    """The request seed of model turn `turn` (from 1); turn 1 uses the episode's own."""
    return seed if turn == 1 else (seed * 1_000_003 + turn) % 2**63


def run_episodes(engine: RolloutEngine, tokenizer: Any, scheduler: MultiTurnScheduler,
                 prompts: Sequence[Prompt], sampling: SamplingConfig, seeds: Sequence[int],
                 settings: MultiTurnSettings,
                 keep_going: Callable[[int], bool] = lambda active: active > 0
                 ) -> List[Trajectory]:
    """One trajectory per prompt (module docstring). `keep_going(n)`: whether to run another
    turn when n of this rank's episodes are still running (collective engines: true while any
    rank has one)."""
    running = [_start(scheduler, tokenizer, prompt, seed, settings)
               for prompt, seed in zip(prompts, seeds)]
    try:
        turn = 0
        while True:
            active = [r for r in running if r.finish_reason is None]
            if not keep_going(len(active)):
                break
            turn += 1
            completions = engine.generate([r.prompt_ids + r.ids for r in active], sampling,
                                          [turn_seed(r.seed, turn) for r in active])
            for episode_run, completion in zip(active, completions):
                _advance(episode_run, completion, turn, scheduler, tokenizer, settings)
    finally:
        for r in running:
            resolve(scheduler.close(r.episode))
    return [r.trajectory() for r in running]


def _start(scheduler: MultiTurnScheduler, tokenizer: Any, prompt: Prompt, seed: int,
           settings: MultiTurnSettings) -> _Running:
    episode = Episode(prompt.messages, prompt.columns, prompt.prompt_id)
    resolve(scheduler.start(episode))
    if episode.messages == list(prompt.messages):
        ids = list(prompt.input_ids)
    else:
        ids = tokens.prompt_ids(tokenizer, episode.messages, settings.template_kwargs)
    running = _Running(episode, ids, seed)
    if running.room(settings) < 1:
        raise UserError(f"multi-turn: the first prompt of dataset row {prompt.prompt_id} has "
                        f"{len(ids)} tokens, leaving no room under --max_length "
                        f"{settings.max_length}")
    return running


def _advance(r: _Running, completion: Completion, turn: int, scheduler: MultiTurnScheduler,
             tokenizer: Any, settings: MultiTurnSettings) -> None:
    """Append the model's turn, ask the scheduler, append its messages or finish."""
    room = r.room(settings)
    ids, logprobs = completion.token_ids[:room], completion.logprobs
    reason = completion.finish_reason if len(completion.token_ids) <= room else "length"
    r.add(ids, None if logprobs is None else logprobs[:room], 1)
    r.turns.append(list(ids))
    r.weight_version = completion.weight_version
    text = tokenizer.decode(ids, skip_special_tokens=True)
    episode = r.episode
    episode.messages.append({"role": "assistant", "content": text})
    episode.turn, episode.finish_reason, episode.token_ids = turn, reason, list(ids)
    answer = resolve(scheduler.step(episode, text, turn))
    if not isinstance(answer, Turn):
        raise UserError(f"{type(scheduler).__name__}.step must return a Turn, got "
                        f"{type(answer).__name__}")
    episode.rewards.append(float(answer.reward))
    episode.info.update(answer.info)
    cut = reason == "length" and (scheduler.stop_when_truncated or r.room(settings) < 1)
    if answer.done or not answer.messages or cut \
            or (settings.max_turns and turn >= settings.max_turns):
        r.finish_reason = reason
        return
    end_of_turn = tokenizer.decode(ids[-1:]) if ids and reason == "stop" else None
    written = agent.tool_results(answer.messages) if settings.agent_template == "hermes" \
        else answer.messages
    env_ids = tokens.turn_ids(tokenizer, written, end_of_turn, settings.template_kwargs)
    if r.room(settings, extra=len(env_ids)) < 1:   # no room left for the model's answer
        r.finish_reason = "length"
        return
    r.add(env_ids, [0.0] * len(env_ids), 0)
    episode.messages.extend(dict(m) for m in answer.messages)


def multi_turn_metrics(infos: Sequence[Dict[str, Any]], env_tokens: Sequence[int],
                       model_tokens: Sequence[int]) -> Dict[str, float]:
    """Rollout metrics of a batch of trajectories (their rollout_infos, and the scheduler's and
    the model's token counts): turns per episode, the episode's total reward, each turn's mean
    reward over the episodes that reached it, and the token split."""
    if not infos:
        return {}
    n = len(infos)
    turns = [info["num_turns"] for info in infos]
    metrics = {"multi_turn/num_turns_mean": sum(turns) / n,
               "multi_turn/num_turns_max": float(max(turns)),
               "multi_turn/episode_reward_mean": sum(i["total_reward"] for i in infos) / n,
               "multi_turn/env_tokens_mean": sum(env_tokens) / n,
               "multi_turn/model_tokens_mean": sum(model_tokens) / n}
    for k in range(max(turns)):
        rewards = [i["step_rewards"][k] for i in infos if len(i["step_rewards"]) > k]
        metrics[f"multi_turn/turn_{k + 1}_reward_mean"] = sum(rewards) / len(rewards)
    return metrics
