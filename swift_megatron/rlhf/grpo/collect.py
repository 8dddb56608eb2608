"""Collect one rollout batch for this data-parallel rank: generate, score, resample; then
(once the trainer has the logprobs --kl_in_reward needs) the advantages.

The DP rank's prompts are expanded into num_generations requests each; the ranks of one model
replica (TP x PP x CP, "mp group") split those requests evenly, generate and compute rewards for
their share (each completion scored exactly once), and all-gather the scored samples, so every
rank of the replica holds the same list in the same canonical order (prompt, then sample).
Advantages need every DP rank's rewards (batch std, global metrics): one all_gather of a small
tensor, keyed by group id, so nothing depends on rank order.

With a multi-turn scheduler (--multi_turn_scheduler, or the rollout servers') each request is a
whole conversation (rollout/multi_turn): the sample holds every token after the prompt with a
loss mask, rewards score the model's last answer, and multi_turn/ metrics are gathered.

Prompts with images (a vision-language model, `images`: its ImageEncoder): each distinct prompt's
images are encoded once per call; the engine gets them with the requests and each sample keeps
the same pixels, grids and the prompt's 3-D positions for the training passes.
"""
import dataclasses
import math
from concurrent.futures import Executor, Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from swift_megatron.data import Prompt
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.rewards import score_rewards
from swift_megatron.rlhf.grpo.advantages import compute_advantages, overflow_problem
from swift_megatron.rlhf.grpo.batch import Sample
from swift_megatron.rlhf.grpo.filtering import zero_std_prompt_ids
from swift_megatron.rollout.engine import RolloutEngine, SamplingConfig
from swift_megatron.rollout.multi_turn import (MultiTurnScheduler, MultiTurnSettings, Trajectory,
                                               multi_turn_metrics, run_episodes)

logger = get_logger(__name__)


@dataclasses.dataclass
class CollectSettings:
    num_generations: int
    sampling: SamplingConfig
    reward_names: List[str]
    reward_weights: List[float]
    scale_rewards: str
    dynamic_sample: bool
    max_resample_times: int
    advantage_estimator: str = "grpo"
    kl_beta: float = 0.0          # --kl_in_reward: rewards minus kl_beta x completion KL
    multi_turn: Optional[MultiTurnSettings] = None   # with a scheduler: the turn budget
    reward_error_policy: str = "raise"   # skip: a reward function's exception scores None


@dataclasses.dataclass
class TrainerState:
    """What reward functions see of the trainer (ms-swift's `trainer_state` keyword argument):
    optimizer steps done before this rollout, and the steps of the whole run. The trainer keeps
    them current (`collector.trainer_state.global_step = step`)."""

    global_step: int = 0
    max_steps: int = 0


class RolloutCollector:
    def __init__(self, engine: RolloutEngine, reward_funcs: Sequence[Tuple[str, Callable]],
                 tokenizer, settings: CollectSettings, mp_group, dp_group,
                 resample_source: Callable[[int], List[Prompt]], device: torch.device,
                 scheduler: Optional[MultiTurnScheduler] = None, images: Any = None):
        self.engine, self.reward_funcs, self.tokenizer = engine, list(reward_funcs), tokenizer
        self.images = images
        self.settings, self.mp_group, self.dp_group = settings, mp_group, dp_group
        self.resample_source, self.device = resample_source, device
        self.scheduler = scheduler
        # multi-turn: our scheduler, or the rollout servers' (server mode, `megatron rollout
        # --multi_turn_scheduler`)
        self.server_scheduler = getattr(engine, "server_scheduler", None)
        self.multi_turn = scheduler is not None or self.server_scheduler is not None
        if self.multi_turn and settings.multi_turn is None:
            raise ValueError("multi-turn rollouts need CollectSettings.multi_turn")
        self.trainer_state = TrainerState()

    # ---- generation and scoring, shared by the ranks of one model replica ----------------
    def _share(self, count: int) -> slice:
        rank, size = dist.get_rank(self.mp_group), dist.get_world_size(self.mp_group)
        per, extra = divmod(count, size)
        start = rank * per + min(rank, extra)
        return slice(start, start + per + (1 if rank < extra else 0))

    def generate_and_score(self, prompts: Sequence[Prompt], group_ids: Sequence[int],
                           seed: int, num_generations: Optional[int] = None,
                           generated: Optional[Future] = None,
                           on_finished: Optional[Callable] = None) -> List[Sample]:
        """num_generations (default: the training setting) scored samples per prompt, identical
        on every rank of the replica and independent of the parallel layout (per-request
        seeds). `generated`: this rank's completions of the same call, started earlier by
        start_generation (--async_generate). `on_finished`: the colocate engine's report of
        finished requests between its steps (rlhf/grpo/tail.py), single-turn."""
        mine, seeds = self._requests(prompts, group_ids, seed, num_generations)
        requested = [prompts[i] for i, _ in mine]
        inputs = self.image_inputs(requested)
        completions = generated.result() if generated is not None \
            else self._generate(requested, seeds, inputs, on_finished)
        local = self._score(requested, [group_ids[i] for i, _ in mine], completions, inputs)
        parts: List[List[Sample]] = [None] * dist.get_world_size(self.mp_group)
        dist.all_gather_object(parts, local, group=self.mp_group)
        return [s for part in parts for s in part]

    def start_generation(self, prompts: Sequence[Prompt], group_ids: Sequence[int], seed: int,
                         executor: Executor) -> Future:
        """This rank's completions of generate_and_score(prompts, group_ids, seed), generated
        by `executor` (a background thread: --async_generate). Single-turn only: the engine
        call is the only collective, on the engine's own process group."""
        if self.multi_turn:
            raise ValueError("start_generation: multi-turn rollouts run turn by turn")
        mine, seeds = self._requests(prompts, group_ids, seed)
        requested = [prompts[i] for i, _ in mine]
        return executor.submit(self._generate, requested, seeds, self.image_inputs(requested))

    def _requests(self, prompts: Sequence[Prompt], group_ids: Sequence[int], seed: int,
                  num_generations: Optional[int] = None) -> Tuple[List[Tuple[int, int]], List[int]]:
        """This rank's share of the (prompt index, sample index) requests, and their seeds."""
        g = num_generations or self.settings.num_generations
        requests = [(i, k) for i in range(len(prompts)) for k in range(g)]
        mine = requests[self._share(len(requests))]
        return mine, [_request_seed(seed, group_ids[i], k) for i, k in mine]

    def image_inputs(self, prompts: Sequence[Prompt]) -> Optional[List[Optional[dict]]]:
        """Per request: None, or its prompt's encoded images plus `positions` (the prompt's
        [3, P] M-RoPE ids); each distinct prompt is encoded once. None when no prompt has
        images."""
        if not any(p.images for p in prompts):
            return None
        encoded: Dict[int, dict] = {}
        for prompt in prompts:
            if prompt.images and id(prompt) not in encoded:
                inputs = self.images.encode(prompt.images)
                inputs["positions"] = self.images.positions(prompt.input_ids,
                                                            inputs["image_grid_thw"])
                encoded[id(prompt)] = inputs
        return [encoded.get(id(p)) for p in prompts]

    def _generate(self, prompts: List[Prompt], seeds: List[int],
                  inputs: Optional[List[Optional[dict]]] = None,
                  on_finished: Optional[Callable] = None) -> list:
        """One completion per prompt: a single engine call, or with a scheduler one multi-turn
        Trajectory each (every rank runs the same number of turns: the engines are
        collective), or the servers' trajectories. `inputs`: image_inputs(prompts)."""
        if self.server_scheduler is not None:
            return self.engine.rollout(prompts, self.settings.sampling, seeds,
                                       self.settings.multi_turn)
        if self.scheduler is None:
            extra = {} if inputs is None else {"images": inputs}
            extra.update({} if on_finished is None else {"on_finished": on_finished})
            return self.engine.generate([p.input_ids for p in prompts], self.settings.sampling,
                                        seeds, **extra)
        return run_episodes(self.engine, self.tokenizer, self.scheduler, prompts,
                            self.settings.sampling, seeds, self.settings.multi_turn,
                            keep_going=lambda active: self._reduce(active, dist.ReduceOp.MAX) > 0)

    def _score(self, prompts: List[Prompt], group_ids: List[int], completions,
               inputs: Optional[List[Optional[dict]]] = None) -> List[Sample]:
        if not prompts:
            return []
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions],
                                            skip_special_tokens=True)
        # multi-turn: rewards score the model's last answer (ms-swift), the log shows everything
        answers = [c.last_answer if isinstance(c, Trajectory) else text
                   for c, text in zip(completions, texts)]
        per_func, raised = score_rewards(self.reward_funcs, answers, reward_columns(
            prompts, group_ids, completions, answers, self.trainer_state),
            on_error=self.settings.reward_error_policy)
        samples = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            rewards = [values[row] for values in per_func]
            failed = [row in rows for rows in raised]
            multi = isinstance(completion, Trajectory)
            samples.append(Sample(
                group_id=group_ids[row], prompt_id=prompt.prompt_id,
                prompt_ids=list(completion.prompt_ids if multi else prompt.input_ids),
                completion_ids=completion.token_ids, rollout_logprobs=completion.logprobs,
                finish_reason=completion.finish_reason, rewards=rewards,
                reward=_weighted(rewards, self.settings.reward_weights),
                reward_raised=failed if any(failed) else None,
                weight_version=completion.weight_version, completion_text=texts[row],
                loss_mask=completion.loss_mask if multi else None,
                rollout_infos=completion.rollout_infos if multi else None,
                routed_experts=None if multi else completion.routed_experts))
            attach_images(samples[-1], None if inputs is None else inputs[row])
        return samples

    # ---- dynamic sampling (DAPO) ---------------------------------------------------------
    def resample_zero_std_groups(self, samples: List[Sample], seed: int) -> Tuple[List[Sample], int]:
        """Replace groups whose rewards all agree by groups of fresh prompts, up to
        max_resample_times rounds; returns the samples and the groups still without signal.
        Every rank joins every round (engines may be collective) until no rank needs one."""
        for round_index in range(self.settings.max_resample_times + 1):
            bad = self._zero_std_groups(samples)
            if self._reduce(len(bad), dist.ReduceOp.MAX) == 0 \
                    or round_index == self.settings.max_resample_times:
                return samples, len(bad)
            fresh = self.generate_and_score(self.resample_source(len(bad)), bad,
                                            seed + 7919 * (round_index + 1))
            samples = _replace_groups(samples, fresh)
        return samples, 0

    def _zero_std_groups(self, samples: List[Sample]) -> List[int]:
        if not samples:
            return []
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        groups = torch.tensor([s.group_id for s in samples])
        return zero_std_prompt_ids(rewards, groups).tolist()

    # ---- advantages over the whole rollout batch -----------------------------------------
    def assign_advantages(self, samples: List[Sample],
                          kl: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """Set each sample's advantage from the rewards of every DP rank (with --kl_in_reward,
        `kl` [len(samples)]: each sample's KL to the reference); returns rollout metrics."""
        n_funcs, s = len(self.reward_funcs), self.settings
        rows = _sample_rows(samples, n_funcs, kl).to(self.device)
        table = _gather_rows(rows, self.dp_group).cpu()
        groups = table[:, n_funcs + 1].long()
        weights = torch.tensor(s.reward_weights, dtype=table.dtype)
        advantages, metrics = compute_advantages(
            table[:, :n_funcs], weights, groups, estimator=s.advantage_estimator,
            scale_rewards=s.scale_rewards, kl=None if kl is None else table[:, n_funcs + 4],
            beta=s.kl_beta)
        problem = overflow_problem(table[:, :n_funcs], weights, advantages, metrics,
                                   s.reward_names)
        if problem:   # every rank has the whole table: all stop together
            raise UserError(problem)
        start = dist.get_rank(self.dp_group) * len(samples)
        for sample, value in zip(samples, advantages[start:start + len(samples)].tolist()):
            sample.advantage = value
        return _rollout_metrics(table, metrics, s.reward_names, kl is not None,
                                s.reward_error_policy == "skip")

    def collect(self, prompts: Sequence[Prompt], group_ids: Sequence[int], seed: int,
                generated: Optional[Future] = None, on_finished: Optional[Callable] = None
                ) -> Tuple[List[Sample], Dict[str, float]]:
        """This DP rank's scored samples (group ids: unique per prompt slot over the run),
        advantages not yet assigned (assign_advantages). `generated`, `on_finished`: see
        generate_and_score (the first generation only, not dynamic-sampling rounds)."""
        samples = self.generate_and_score(prompts, group_ids, seed, generated=generated,
                                          on_finished=on_finished)
        unresolved = 0
        if self.settings.dynamic_sample:
            samples, unresolved = self.resample_zero_std_groups(samples, seed)
            if unresolved:
                logger.warning(f"dynamic_sample: {unresolved} group(s) still had zero reward std "
                               f"after {self.settings.max_resample_times} resampling round(s); "
                               "kept them")
        metrics = {"rollout/unresolved_zero_std_groups":
                   float(self._reduce(unresolved, dist.ReduceOp.SUM, self.dp_group))}
        if self.multi_turn:
            metrics.update(self._multi_turn_metrics(samples))
        return samples, metrics

    def _multi_turn_metrics(self, samples: List[Sample]) -> Dict[str, float]:
        """multi_turn/ metrics over every DP rank's trajectories."""
        mine = [(s.rollout_infos, s.loss_mask.count(0), s.loss_mask.count(1)) for s in samples]
        parts: List[list] = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(parts, mine, group=self.dp_group)
        rows = [row for part in parts for row in part]
        return multi_turn_metrics([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])

    def _reduce(self, value: int, op, group=None) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=op, group=group)
        return int(tensor.item())


def attach_images(sample: Sample, inputs: Optional[dict]) -> Sample:
    """The sample with its prompt's images (an image_inputs entry; None: text only)."""
    if inputs is not None:
        sample.pixel_values = inputs["pixel_values"]
        sample.image_grid_thw, sample.prompt_positions = inputs["image_grid_thw"], inputs["positions"]
    return sample


def reward_columns(prompts: Sequence[Prompt], group_ids: Sequence[int], completions,
                   texts: Sequence[str], trainer_state: TrainerState) -> Dict[str, Any]:
    """The keyword arguments of the reward functions, one list entry per completion: ms-swift's
    names (messages: the prompt's chat turns plus the completion as the last assistant turn,
    prompt_id: the group id shared by one prompt's completions, finish_reason, is_truncated,
    response_token_ids: the model's token ids per turn, and trainer_state, one object for
    the batch; multi-turn trajectories: messages is the whole conversation, and rollout_infos
    the scheduler's metadata with num_turns, step_rewards and total_reward), then the dataset
    columns, which win over ms-swift's names as in ms-swift, then our names (prompts, completion_ids, truncated), which datasets may not use
    (data/prompts.py RESERVED_COLUMNS)."""
    truncated = [c.truncated for c in completions]
    multi = bool(completions) and all(isinstance(c, Trajectory) for c in completions)
    ms_swift = dict(
        messages=[[dict(m) for m in c.messages] if multi else
                  [dict(m) for m in p.messages] + [{"role": "assistant", "content": text}]
                  for p, c, text in zip(prompts, completions, texts)],
        prompt_id=list(group_ids), finish_reason=[c.finish_reason for c in completions],
        is_truncated=list(truncated),
        response_token_ids=[[list(t) for t in c.turn_token_ids] if multi else [list(c.token_ids)]
                            for c in completions],
        trainer_state=trainer_state)
    if multi:
        ms_swift["rollout_infos"] = [dict(c.rollout_infos) for c in completions]
    columns = {key: [p.columns.get(key) for p in prompts] for key in prompts[0].columns}
    ours = dict(prompts=[p.text for p in prompts], truncated=truncated,
                completion_ids=[c.token_ids for c in completions])
    return {**ms_swift, **columns, **ours}


def _request_seed(seed: int, group_id: int, sample: int) -> int:
    """One seed per (prompt slot, sample): group ids are unique over the run, so every request
    of every rollout gets its own stream, whichever rank generates it."""
    return ((seed * 1_000_003 + group_id) * 4099 + sample) % 2**63


def _weighted(rewards: List, weights: List[float]) -> float:
    """Weighted sum; None (not applicable) counts as 0, as TRL's nansum."""
    return float(sum(w * r for w, r in zip(weights, rewards) if r is not None))


def _replace_groups(samples: List[Sample], fresh: List[Sample]) -> List[Sample]:
    by_group: Dict[int, List[Sample]] = {}
    for sample in fresh:
        by_group.setdefault(sample.group_id, []).append(sample)
    result, done = [], set()
    for sample in samples:
        if sample.group_id in by_group:
            if sample.group_id not in done:
                result += by_group[sample.group_id]
                done.add(sample.group_id)
        else:
            result.append(sample)
    return result


def _sample_rows(samples: List[Sample], n_funcs: int,
                 kl: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, 2F + 5]: rewards per function (NaN for None), total, group id, length, truncated, KL
    to the reference (0 without kl), then per function 1 where it raised (reward_raised)."""
    kl_values = [0.0] * len(samples) if kl is None else kl.tolist()
    rows = [[math.nan if r is None else float(r) for r in s.rewards]
            + [s.reward, float(s.group_id), float(len(s.completion_ids)), float(s.truncated), k]
            + [float(x) for x in s.reward_raised or [False] * n_funcs]
            for s, k in zip(samples, kl_values)]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(samples), 2 * n_funcs + 5)


def _gather_rows(rows: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, rows, group=group)
    return torch.cat(parts)


def _rollout_metrics(table: torch.Tensor, adv_metrics: Dict[str, float],
                     names: List[str], with_kl: bool, with_errors: bool) -> Dict[str, float]:
    """Metrics of the gathered _sample_rows table; with_errors (--reward_error_policy skip):
    reward/<name>/errors, the completions each function raised on."""
    n_funcs = len(names)
    lengths, truncated = table[:, n_funcs + 2], table[:, n_funcs + 3]
    metrics = {"reward/mean": adv_metrics["reward_mean"], "reward/std": adv_metrics["reward_std"],
               "reward/frac_zero_std": adv_metrics["frac_reward_zero_std"],
               "rollout/completion_length_mean": lengths.mean().item(),
               "rollout/completion_length_min": lengths.min().item(),
               "rollout/completion_length_max": lengths.max().item(),
               "rollout/truncated_fraction": truncated.mean().item(),
               "rollout/completion_tokens": lengths.sum().item()}
    if with_kl:  # --kl_in_reward: the mean completion KL taken out of the rewards (before beta)
        metrics["reward/kl"] = table[:, n_funcs + 4].mean().item()
    for column, name in enumerate(names):
        values = table[:, column]
        metrics[f"reward/{name}/mean"] = values.nanmean().item()
        metrics[f"reward/{name}/std"] = values[~values.isnan()].std().item() if values.numel() > 1 else 0.0
        if with_errors:
            metrics[f"reward/{name}/errors"] = table[:, n_funcs + 5 + column].sum().item()
    return metrics
