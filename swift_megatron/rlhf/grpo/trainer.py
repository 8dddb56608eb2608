"""The GRPO loop on Megatron-core (DESIGN.md section 2), one rollout batch at a time:

  rollout (generate + rewards) -> old / ref / teacher logprobs when needed (pipelined
  forward-only passes, passes.py) -> advantages -> num_iterations x steps_per_generation
  optimizer steps of global_batch_size completions through forward_backward_func (with
  --sync_ref_model, the reference follows the policy every ref_model_sync_steps) -> weight sync
  to the engine -> metrics -> checkpoint. A frozen vision tower runs once per image of the
  rollout batch (model/vision_cache.py). With --async_generate the next batch's generation
  (rollout servers, or the colocated engine) runs in a background thread from the rollout to
  the weight sync (prefetch.py); with --tail_logprobs the passes of the completions that
  finished early run while the engine still decodes the others (tail.py).

Run it with `megatron rlhf --rlhf_type grpo ...` (cli/rlhf.py) or `run_grpo(args, plan)`.
"""
import contextlib
import dataclasses
import math
import os
import shutil
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from swift_megatron.arguments.batch_plan import BatchPlan
from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.checkpoint import run as run_checkpoint
from swift_megatron.checkpoint.run_dir import resumes
from swift_megatron.checkpoint.start import check_resume_step, plan_start
from swift_megatron.checkpoint.trainer import (adam_step, iteration_dir, load_checkpoint,
                                               save_checkpoint)
from swift_megatron.errors import NumericsError, UserError, WeightSyncError
from swift_megatron.launch import raise_if_stopping
from swift_megatron.logging import get_logger, reduce_metrics
from swift_megatron.logging.progress import progress
from swift_megatron.lora import save_adapter
from swift_megatron.lora.peft_io import ADAPTER_CONFIG
from swift_megatron.model.config import load_hf_config
from swift_megatron.model.vision_cache import frozen_tower_cache
from swift_megatron.model.wrappers import unwrap
from swift_megatron.parallel.context import padding_multiples
from swift_megatron.paths import removed_if_failed
from swift_megatron.report import write_run_report
from swift_megatron.report.run_record import record_run
from swift_megatron.rlhf.grpo import components as build
from swift_megatron.rlhf.grpo import numerics
from swift_megatron.rlhf.grpo.batch import Sample, fixed_length, split_micro_batches, to_device
from swift_megatron.rlhf.grpo.collect import attach_images
from swift_megatron.rlhf.grpo.ending import RunEnd, closing_lines, existing
from swift_megatron.rlhf.grpo.losses import logprob_mismatch
from swift_megatron.rlhf.grpo.no_signal import NoSignalWatch
from swift_megatron.rlhf.grpo.objective import StepConstants, collect_logprobs, grpo_loss
from swift_megatron.rlhf.grpo.passes import completion_kl, fill_logprobs, write_advantages
from swift_megatron.rlhf.grpo.prefetch import RolloutPrefetch, staleness_metrics
from swift_megatron.rlhf.grpo import tail
from swift_megatron.rlhf.grpo.step_metrics import step_metrics
from swift_megatron.rollout.engine import SamplingConfig
from swift_megatron.rollout.timeline import timing_metrics
from swift_megatron.rollout.watchdog import Watchdog
from swift_megatron.training.gc_pauses import GcClock
from swift_megatron.training.guard import SkipGuard, check_finite_weights
from swift_megatron.training.moe_losses import moe_loss_metrics
from swift_megatron.training.profile import (device_memory, host_memory, maybe_profile,
                                              measure_phase)
from swift_megatron.training.step import (contribution_scale, forward_backward, gather_params,
                                          optimizer_step, zero_grads)

logger = get_logger(__name__)
EVAL_GROUP_OFFSET = 10**12  # evaluation group ids (seeds) never collide with training stream positions
SYNC_CHECK_PROMPTS, SYNC_CHECK_TOKENS = 4, 16  # --check_weight_sync: fixed prompts, tokens each


class GRPOTrainer:
    def __init__(self, args: RlhfArguments, plan: BatchPlan):
        self.args, self.plan = args, plan
        self.started, self.report = time.monotonic(), None   # for the run's last lines
        self.steps_per_rollout = plan.steps_per_generation * args.grpo.num_iterations
        self.state = build.parallel_state(args)
        start = plan_start(args.training, args.lora)
        for notice in start.notices if self.state.rank == 0 else []:
            logger.warning(notice)
        self.output_dir = build.output_dir(args, self.state)
        self.save_dir = args.training.save or self.output_dir
        self.run_lock = build.claim_run_dirs(args, self.state, self.output_dir, start.resume_dir)
        model_dir = build.model_dir(args, start)
        hf_config = load_hf_config(model_dir)
        self.tokenizer = build.tokenizer(model_dir, hf_config)
        images = build.image_encoder(args, model_dir, hf_config)
        self.train_prompts, self.val_prompts = build.prompts(args, self.tokenizer, hf_config,
                                                             images)
        build.check_images(args, self.state, self.train_prompts + self.val_prompts)
        self.eval_steps = build.eval_steps(args, bool(self.val_prompts))
        self.train_iters = build.train_iters(args, plan, len(self.train_prompts))
        check_resume_step(start.resume_dir, self.train_iters)   # before building anything
        self.policy = build.policy(args, self.state, model_dir, self.train_iters, start)
        self.reference = build.reference_model(args, self.state, self.policy, start, self.tokenizer)
        self.teacher = build.teacher(args, self.state, self.policy, self.tokenizer)
        self.sampler, fresh = build.samplers(args, plan, self.state, self.train_prompts)
        self.engine = build.engine(args, self.state, self.policy, self.tokenizer,
                                   self.train_prompts + self.val_prompts)
        self.sync_filter, self.synced = build.sync_filter(args, self.policy), False
        self.sync_watchdog = Watchdog(args.rollout.weight_sync_timeout)
        frozen = (self.reference.frozen or []) + (self.teacher.chunks if self.teacher else [])
        self.offloaders = build.offloaders(args, self.state, self.policy, frozen)
        self.reward_funcs = build.rewards(args, self.state.device)
        self.collector = build.collector(args, self.state, self.engine, self.tokenizer,
                                         self.reward_funcs, fresh, hf_config, images)
        self.collector.trainer_state.max_steps = self.train_iters
        self.tail_kinds = tail.tail_kinds(args, plan.steps_per_generation,
                                          build.engine_kind(args, self.state.device) == "colocate",
                                          any(p.images for p in self.train_prompts))
        self.tail: Optional[tail.TailPasses] = None   # the rollout batch's, until fill_logprobs
        self.loss_settings = build.loss_settings(args, self.policy)
        self.metrics_log, self.completions_log = build.loggers(args, self.state, self.output_dir,
                                                               {"plan": vars(plan)})
        if self.state.rank == 0:  # the flags and plan, for the report and for ms-swift's tools
            record_run(self.output_dir, "megatron rlhf", args, plan, self.train_iters)
        self.step = 0
        self.generation_memory: Dict[str, float] = {}   # generating(): the device at its end
        self.numerics_pending = self._numerics_gate_applies(start)
        self.skip_guard = SkipGuard(args.training.max_skipped_steps)
        self.no_signal = NoSignalWatch(args.grpo.num_generations, args.grpo.temperature,
                                       self.steps_per_rollout)
        self.prefetch = self._prefetch()
        self.resumes_save_dir = resumes(self.save_dir, start.resume_dir)  # continues a run
        if start.resume_dir:
            state = self._resume(start.resume_dir)
            if state and self.resumes_save_dir:
                self._finish_interrupted_save(start.resume_dir, state.get("reward"))

    # ---- the loop --------------------------------------------------------------------------
    def train(self) -> Dict[str, float]:
        if self.step >= self.train_iters:   # a finished run resumed: nothing to redo
            logger.info(f"the checkpoint is at step {self.step} of {self.train_iters}: nothing to "
                        "train (raise --train_iters to continue)")
            if self.resumes_save_dir and not os.path.isdir(os.path.join(self.output_dir,
                                                                        "final_hf")):
                self.export_final()   # the run was stopped while writing its final model
            self.close()
            return {}
        try:
            metrics = self._train()
        except BaseException:   # an error, Ctrl-C or SIGTERM (cli/rlhf.py)
            self.engine.abandon()   # a rollout server's weight-sync communicator
            self.run_lock.release()
            raise
        self.close()
        if self.state.rank == 0:
            for line in closing_lines(self._run_end()):
                logger.info(line)
        return metrics

    def _train(self) -> Dict[str, float]:
        batches = math.ceil((self.train_iters - self.step) / self.steps_per_rollout)
        logger.info(f"GRPO: {self.train_iters} optimizer steps, {batches} rollout batches\n"
                    f"{self.plan.table()}")
        self.sync_weights()
        metrics: Dict[str, float] = {}
        t = self.args.training
        # the bar closes before the run's last save, so the report's lines come after it
        with GcClock() as gc_clock, progress(range(1, batches + 1), desc="GRPO") as bar:
            for index in bar:
                raise_if_stopping()   # a SIGTERM whose SystemExit a gc callback swallowed
                paused = gc_clock.seconds
                with maybe_profile(index, self.state.rank):
                    metrics = self.train_rollout_batch()
                metrics["perf/gc_pause_s"] = gc_clock.seconds - paused
                self._warn(self.no_signal.update(self.step, metrics))
                if self._crossed(self.eval_steps):
                    metrics.update(self.evaluate())
                if self._crossed(t.logging_steps):
                    self.metrics_log.log(self.step, metrics)
                if t.exit_interval and self.step >= t.exit_interval:
                    break
                if self._crossed(t.save_steps) and self.step < self.train_iters:
                    self.save(metrics)
        self._warn(self.no_signal.finish(self.step, metrics))
        if self._saved_step != self.step:
            self.save(metrics)  # every run ends with a save, and so with the final report
        if self.step >= self.train_iters:
            self.export_final()
        return metrics

    def train_rollout_batch(self) -> Dict[str, float]:
        timings: Dict[str, float] = {}
        device = self.state.device
        with measure_phase("rollout", timings, device):
            samples, metrics = self.collect()
        steps = self.step_micro_batches(samples)
        # a frozen vision tower runs once per image of the rollout batch (vision_cache.py)
        with frozen_tower_cache(self.policy.chunks, self.reference.frozen):
            with measure_phase("logprobs", timings, device):
                self.fill_logprobs(steps, samples)
            metrics.update(self.assign_advantages(samples, [mb for step in steps for mb in step]))
            with measure_phase("train", timings, device):
                train_metrics = [self.optimizer_step(micro)
                                 for micro in steps * self.args.grpo.num_iterations]
                gather_params(self.policy.chunks)   # --overlap_param_gather: for the readers
        metrics.update(self.sync_weights(timings))
        metrics.update(reduce_metrics(train_metrics))
        metrics.update(timings)
        metrics.update(self._throughput(samples, timings))
        metrics.update(host_memory())
        if device.type == "cuda":  # this rank's peak over the rollout batch's phases
            metrics["perf/max_memory_allocated_gib"] = max(
                value for key, value in timings.items() if key.startswith("memory/"))
            metrics.update({f"memory/generate_{key}": value
                            for key, value in self.generation_memory.items()})
            asleep = getattr(self.engine, "allocated_while_asleep", None)
            if asleep is not None:   # colocate: what torch still counts for the sleeping engine
                metrics["memory/engine_asleep_gib"] = asleep / 2**30
        self._log_completions(samples)
        return metrics

    # ---- phases ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def generating(self, timed: bool = False):
        """The engine awake (and, in colocate mode, the training state offloaded if asked).
        An engine whose weights a sleep discarded since the last sync (the sleep after
        --check_weight_sync's or an evaluation's generation) gets the weights pushed again.
        Unless `timed` (the rollout's), the generate calls inside leave no timeline behind
        (rollout/timeline.py: the next rollout batch logs its own)."""
        if self.engine.weights_discarded:
            self._push_weights()
        for offloader in self.offloaders:
            offloader.offload()
        self.engine.wake_up()
        times = getattr(self.engine, "generation_times", [])
        mark = len(times)
        try:
            yield
            # the device as the generation leaves it (engine awake), for the rollout batch's log
            self.generation_memory = device_memory(self.state.device)
        finally:
            self.engine.sleep()
            for offloader in self.offloaders:
                offloader.reload()
            if not timed:
                del times[mark:]

    def collect(self):
        """This rank's samples of the next rollout batch (with --async_generate, generated
        while the previous batch trained, and the batch after started before returning)."""
        pending = self.prefetch.take() if self.prefetch else None
        group_ids, prompts = (pending.group_ids, pending.prompts) if pending else self._draw()
        self.collector.trainer_state.global_step = self.step
        seed = self.args.training.seed
        self.tail = self._tail_passes(prompts, group_ids)
        with self.generating(timed=True):
            samples, metrics = self.collector.collect(
                prompts, group_ids, seed=seed, generated=pending and pending.generated,
                on_finished=self.tail and self.tail.on_finished)
        if self.tail:
            metrics.update(self.tail.generation_done())
        metrics.update(timing_metrics(getattr(self.engine, "take_generation_times", list)()))
        if self.prefetch:
            metrics.update(staleness_metrics(samples, self.engine.weight_version))
            if self._another_batch():
                state = self.sampler.state_dict()
                next_ids, next_prompts = self._draw()
                self.prefetch.start(self.collector, next_prompts, next_ids, seed, state)
        return samples, metrics

    def _draw(self):
        """The next batch's group ids (stream positions: unique over the run) and prompts."""
        group_ids = self.sampler.batch_sample_ids()
        return group_ids, [self.train_prompts[i] for i in next(self.sampler)]

    def _tail_passes(self, prompts, group_ids) -> Optional[tail.TailPasses]:
        """--tail_logprobs: the rollout batch's passes in the generation's tail (tail.py), told
        which requests come (this rank generates all of its prompts' requests: one process per
        model replica) and which of them the old policy's pass needs (after the first step's)."""
        if not self.tail_kinds:
            return None
        t = tail.build(self.tail_kinds, self.policy.chunks, self.reference, self.loss_settings,
                       lambda group: self.micro_batches(group, micro_batch_size=len(group))[0],
                       self.plan.micro_batch_size, self.args.batch.max_tokens_per_micro_batch)
        g = self.args.grpo.num_generations
        first_step = len(prompts) * g // self.plan.steps_per_generation
        all_old = self._all_old()
        t.expect([(Sample(group_id=group_id, prompt_id=prompt.prompt_id,
                          prompt_ids=list(prompt.input_ids), completion_ids=[],
                          rollout_logprobs=None, finish_reason="", rewards=[]),
                   (tail.REF,) + (tail.OLD,) * (all_old or i * g + k >= first_step))
                  for i, (prompt, group_id) in enumerate(zip(prompts, group_ids))
                  for k in range(g)])
        return t

    def _prefetch(self) -> Optional[RolloutPrefetch]:
        """--async_generate's background generation (single-turn, on vLLM: checked by the
        arguments, and here for the servers' own multi-turn scheduler and the engine the run
        got); the colocated engine's thread gets a CUDA stream of its own."""
        if not self.args.grpo.async_generate:
            return None
        if self.collector.multi_turn:
            raise UserError("--async_generate true does not support multi-turn rollouts, and "
                            "the rollout servers run a --multi_turn_scheduler: drop "
                            "--async_generate or restart them without it")
        kind = build.engine_kind(self.args, self.state.device)
        if kind == "hf":
            raise UserError("--async_generate true needs vLLM, and this run generates with the "
                            "embedded transformers engine: pass --use_vllm true (vLLM installed)")
        return RolloutPrefetch(own_stream=kind == "colocate")

    def _another_batch(self) -> bool:
        """Whether a rollout batch follows the one being collected (before its steps)."""
        after, t = self.step + self.steps_per_rollout, self.args.training
        return after < self.train_iters and not (t.exit_interval and after >= t.exit_interval)

    def step_micro_batches(self, samples: List[Sample]) -> List[List[dict]]:
        """This DP rank's micro-batches of each optimizer step of the rollout batch: the step's
        completions split by --micro_batch_size, or by --max_tokens_per_micro_batch. With the
        interleaved pipeline all of them have one shape (batch.py, `length`)."""
        per_step = len(samples) // self.plan.steps_per_generation
        length = None
        if self.state.vpp > 1:
            length = fixed_length(samples, self.plan.micro_batch_size,
                                  self.args.kernels.padding_free, *self._padding_multiples())
        return [self.micro_batches(samples[k * per_step:(k + 1) * per_step],
                                   max_tokens=self.args.batch.max_tokens_per_micro_batch,
                                   length=length)
                for k in range(self.plan.steps_per_generation)]

    def _padding_multiples(self):
        """(row multiple, sequence multiple) of the micro-batches (sequence parallelism, CP)."""
        tp_multiple = self.state.tp if self.args.parallel.sequence_parallel else 1
        return padding_multiples(tp_multiple, self.state.cp)

    def micro_batches(self, samples: List[Sample], micro_batch_size: Optional[int] = None,
                      max_tokens: Optional[int] = None, length: Optional[int] = None) -> List[dict]:
        row_multiple, sequence_multiple = self._padding_multiples()
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        micro = split_micro_batches(samples, micro_batch_size or self.plan.micro_batch_size,
                                    max_tokens=max_tokens, pad_id=pad,
                                    pad_to_multiple=row_multiple,
                                    sequence_multiple=sequence_multiple, length=length,
                                    overlong_filter=self.args.grpo.overlong_filter,
                                    packed=self.args.kernels.padding_free)
        return [to_device(mb, self.state.device) for mb in micro]

    def fill_logprobs(self, steps: List[List[dict]], samples: List[Sample]) -> None:
        """The forward-only passes of passes.py over every step's micro-batches (`samples` in
        order). The first optimizer step's micro-batches skip the old-policy pass unless they are
        trained again or their KL enters the rewards. With --tail_logprobs the rollout batch's
        tail passes computed some of the values during the generation: tail.py runs the rest."""
        micro = [mb for step in steps for mb in step]
        skip_old = 0 if self._all_old() else len(steps[0])
        if self.tail is None:
            fill_logprobs(micro, self.policy.chunks, self.reference, self.teacher,
                          self.loss_settings, skip_old=skip_old, beta=self.args.grpo.beta,
                          record_routes=self.args.moe.router_replay_mode == "R2")
            return
        current, self.tail = self.tail, None
        try:
            current.fill(micro, samples, skip_old)
        finally:
            current.close()
        if self.teacher is not None:
            self.teacher.fill_logprobs(micro, self.loss_settings)

    def _all_old(self) -> bool:
        """Whether every micro-batch needs the old policy's pass: trained again, or its KL
        enters the rewards (else the first step's forward gives the same values)."""
        g = self.args.grpo
        return g.num_iterations > 1 or (g.kl_in_reward and g.beta > 0)

    def assign_advantages(self, samples: List[Sample], micro: List[dict]) -> Dict[str, float]:
        """Advantages from every DP rank's rewards (minus beta x KL with --kl_in_reward), into
        the samples and the micro-batches; returns the reward metrics."""
        g = self.args.grpo
        kl = completion_kl(micro, len(samples), self.state) if g.kl_in_reward and g.beta > 0 \
            else None
        metrics = self.collector.assign_advantages(samples, kl)
        write_advantages(micro, samples)
        return metrics

    def optimizer_step(self, micro: List[dict]) -> Dict[str, float]:
        constants = self._step_constants(micro)
        pol = self.policy
        zero_grads(pol.chunks, pol.optimizer)
        outputs = forward_backward(pol.chunks, micro, partial(grpo_loss, self.loss_settings, constants))
        metrics = step_metrics(outputs, self.state)
        metrics.update(moe_loss_metrics(pol.config, len(micro), self.state.device))
        if self.numerics_pending:
            metrics.update(self.numerics_gate(metrics))
        # "lr": the rate this step updates with, --lr's schedule (groups with --vit_lr /
        # --aligner_lr follow it scaled), read before optimizer_step moves the schedule on
        # (Megatron logs the next step's: 0 on a decay's last step)
        lr = pol.scheduler.get_lr({})
        ok, grad_norm = optimizer_step(pol.optimizer, pol.scheduler)
        self.step += 1
        skipped = self.skip_guard.update(ok, grad_norm, self.step)
        if skipped and self.state.rank == 0:
            logger.warning(skipped)
        g = self.args.grpo
        if g.sync_ref_model and self.step % g.ref_model_sync_steps == 0:
            gather_params(pol.chunks)
            self.reference.mix_in_policy(g.ref_model_mixup_alpha)
        metrics.update({"grad_norm": grad_norm, "lr": lr, "update_skipped": float(not ok)})
        return metrics

    def numerics_gate(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """--numerics_check, once per run before its first update (numerics.py): every rank
        holds the same reduced gap, so every rank stops together."""
        self.numerics_pending = False
        gap = metrics.get(numerics.GAP_METRIC)
        if gap is None:
            if self.state.rank == 0:
                logger.info("numerics check skipped: the rollout engine returned no logprobs")
            return {}
        shape, atol = self.policy.bridge.shape, self.args.rollout.numerics_check_atol
        kind = numerics.model_kind(shape.num_experts, shape.is_hybrid)
        failure = numerics.gate_failure(gap, shape.model_type, kind, atol)
        if failure:
            raise NumericsError(failure)
        return {"numerics/first_step_gap": gap,
                "numerics/tolerance": numerics.tolerance(kind, atol)}

    def _numerics_gate_applies(self, start) -> bool:
        """--numerics_check, unless its two sides are not the same distribution (logged)."""
        if not self.args.rollout.numerics_check:
            return False
        g = self.args.grpo
        reason = numerics.sampling_skip(g.top_p, g.top_k, g.repetition_penalty)
        if reason and self.state.rank == 0:
            logger.info(reason)
        return reason is None and not self._dropout_sample(start)

    def _dropout_sample(self, start) -> bool:
        """Whether the first step's trainer logprobs are a LoRA dropout sample of a trained
        adapter (a fresh adapter adds nothing, B = 0): then the gate has nothing exact to
        compare, and says so."""
        lora = self.args.lora
        sampled = (self.args.training.train_type == "lora" and lora.lora_dropout > 0
                   and bool(start.adapter or start.resume_dir))
        if sampled and self.state.rank == 0:
            logger.info("numerics check skipped: the loaded adapter's first step runs with "
                        "--lora_dropout (pass --lora_dropout 0 to check it)")
        return sampled

    def evaluate(self) -> Dict[str, float]:
        """Rewards of the current policy on the validation prompts (the same samples each time:
        fixed seeds), as eval/ metrics. Prompts are split over DP ranks."""
        mine = self.val_prompts[self.state.dp_rank::self.state.dp]
        group_ids = [EVAL_GROUP_OFFSET + i for i in range(self.state.dp_rank, len(self.val_prompts),
                                                          self.state.dp)]
        self.collector.trainer_state.global_step = self.step
        with self.generating():
            samples = self.collector.generate_and_score(mine, group_ids, self.args.training.seed,
                                                        self.args.grpo.num_generations_eval)
        names = [name for name, _ in self.reward_funcs]
        totals = torch.tensor([sum(s.reward for s in samples), len(samples),
                               sum(len(s.completion_ids) for s in samples)]
                              + [sum(r for s in samples for r in [s.rewards[j]] if r is not None)
                                 for j in range(len(names))], dtype=torch.float64,
                              device=self.state.device)
        dist.all_reduce(totals, group=self.state.dp_group)
        count = max(totals[1].item(), 1.0)
        metrics = {"eval/reward/mean": totals[0].item() / count,
                   "eval/completion_length_mean": totals[2].item() / count,
                   "eval/num_completions": totals[1].item()}
        metrics.update({f"eval/reward/{name}/mean": totals[3 + j].item() / count
                        for j, name in enumerate(names)})
        return metrics

    def sync_weights(self, timings: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """Stream the policy's weights into the engine (once the generation --async_generate
        started is done: never while a request is in flight); after the first sync, without
        the frozen parts of a vision tower (build.sync_filter); with --check_weight_sync,
        verify. Into `timings`: the sync as `time/sync_s`, the check apart as
        `time/sync_check_s` (a generation, with --offload_optimizer / --offload_model their
        moves to host memory and back, and a forward pass: often longer than the sync)."""
        timings = {} if timings is None else timings
        with measure_phase("sync", timings, self.state.device):
            if self.prefetch:
                self.prefetch.wait()
            self._push_weights()
        if not self.args.rollout.check_weight_sync:
            return {}
        with measure_phase("sync_check", timings, self.state.device):
            return self.check_weight_sync()

    def _push_weights(self) -> None:
        tensors = self.policy.bridge.export(self.policy.chunks)
        if self.synced and self.sync_filter is not None:   # every rank runs the whole export
            tensors = ((name, t) for name, t in tensors if self.sync_filter(name))
        with self.sync_watchdog.watch(
                lambda: f"the weight sync after step {self.step}: {self.engine.sync_position}"):
            self.engine.update_weights(tensors)
        self.synced = True

    @torch.no_grad()
    def check_weight_sync(self) -> Dict[str, float]:
        """Sample completions of a few fixed prompts with the engine and compare its logprobs of
        those tokens with the trainer's (temperature 1, forward-only); WeightSyncError past
        --check_weight_sync_atol. Every rank asks the same requests with the same seeds."""
        prompts = self.train_prompts[:SYNC_CHECK_PROMPTS]
        sampling = SamplingConfig(max_tokens=SYNC_CHECK_TOKENS, temperature=1.0)
        inputs = self.collector.image_inputs(prompts)
        with self.generating():
            completions = self.engine.generate([p.input_ids for p in prompts], sampling,
                                               list(range(len(prompts))),
                                               **({} if inputs is None else {"images": inputs}))
        samples = [attach_images(Sample(group_id=i, prompt_id=p.prompt_id,
                                        prompt_ids=list(p.input_ids), completion_ids=c.token_ids,
                                        rollout_logprobs=c.logprobs, finish_reason=c.finish_reason,
                                        rewards=[], routed_experts=c.routed_experts),
                                 None if inputs is None else inputs[i])
                   for i, (p, c) in enumerate(zip(prompts, completions))]
        micro = self.micro_batches(samples, micro_batch_size=len(samples))
        settings = dataclasses.replace(self.loss_settings, temperature=1.0)
        outputs = forward_backward(self.policy.chunks, micro, partial(collect_logprobs, settings),
                                   True)
        found = [logprob_mismatch(outputs[0]["logprobs"], micro[0]["rollout_logprobs"],
                                  micro[0]["completion_mask"]) if self.state.is_last_stage else None]
        if self.state.pp > 1:
            dist.broadcast_object_list(found, src=self.state.last_stage_rank(),
                                       group=self.state.pp_group)
        mismatch, atol = found[0], self.args.rollout.check_weight_sync_atol
        if mismatch["mean"] > atol:
            raise WeightSyncError(
                f"weight sync check failed at step {self.step}: mean |engine - trainer| logprob "
                f"{mismatch['mean']:.4f} (max {mismatch['max']:.4f}) > --check_weight_sync_atol "
                f"{atol}: the rollout engine does not hold the trainer's weights")
        return {"sync/logprob_abs_diff_mean": mismatch["mean"],
                "sync/logprob_abs_diff_max": mismatch["max"]}

    # ---- helpers ---------------------------------------------------------------------------
    def _step_constants(self, micro: List[dict]) -> StepConstants:
        """The step's totals over every DP rank (ranks may hold different numbers of
        micro-batches with --max_tokens_per_micro_batch)."""
        totals = torch.stack([torch.stack([mb["completion_mask"].sum() for mb in micro]).sum(),
                              torch.tensor(float(len(micro)), device=self.state.device)])
        dist.all_reduce(totals, group=self.state.dp_group)
        return StepConstants(
            num_sequences=self.plan.global_batch_size, num_tokens=float(totals[0].item()),
            num_micro_batches=int(totals[1].item()),
            contribution_scale=contribution_scale(len(micro), self.state.dp))

    def _throughput(self, samples: List[Sample], timings: Dict[str, float]) -> Dict[str, float]:
        completion = sum(len(s.completion_ids) for s in samples)
        total = completion + sum(len(s.prompt_ids) for s in samples)
        return {"perf/rollout_tokens_per_s": completion / max(timings["time/rollout_s"], 1e-9),
                "perf/train_tokens_per_s": total * self.plan.dp_size * self.args.grpo.num_iterations
                / max(timings["time/train_s"], 1e-9)}

    def _crossed(self, interval: Optional[int]) -> bool:
        """Whether the last rollout batch's steps reached a multiple of interval."""
        if not interval:
            return False
        spr = self.steps_per_rollout
        return self.step // interval > (self.step - spr) // interval or self.step >= self.train_iters

    def _log_completions(self, samples: List[Sample]) -> None:
        if not self.args.grpo.log_completions or self.state.rank != 0:
            return
        prompt_text = {p.prompt_id: p.text for p in self.train_prompts}
        self.completions_log.log(self.step, [
            dict(prompt_id=s.prompt_id,
                 # multi-turn: the prompt the episode started from (a scheduler may set its own)
                 prompt=prompt_text.get(s.prompt_id, "") if s.rollout_infos is None
                 else self.tokenizer.decode(s.prompt_ids),
                 completion=s.completion_text, reward=s.reward,
                 rewards=dict(zip([n for n, _ in self.reward_funcs], s.rewards)),
                 advantage=s.advantage, length=len(s.completion_ids), truncated=s.truncated,
                 **({} if s.rollout_infos is None else {"rollout_infos": s.rollout_infos}))
            for s in samples])

    # ---- checkpoints -----------------------------------------------------------------------
    _saved_step = -1

    def save(self, metrics: Dict[str, float]) -> None:
        """A resumable checkpoint, its reward in best_checkpoint.json, the HF copies
        --save_safetensors asks for, then the rotation of --save_total_limit (checkpoint/run.py).
        Collective."""
        t, pol = self.args.training, self.policy
        check_finite_weights(pol.chunks, f"checkpoint of step {self.step}")
        reward = metrics.get("reward/mean")
        state = {"step": self.step, "train_iters": self.train_iters,
                 "adam_step": adam_step(pol.optimizer),
                 "scheduler": pol.scheduler.state_dict(), "sampler": self._sampler_state(),
                 "reward": reward if reward is not None and math.isfinite(reward) else None}
        meta = {"model_type": pol.bridge.shape.model_type, "dtype": str(pol.dtype).split(".")[-1],
                "train_type": t.train_type,
                "saved_with": self._saved_with()}
        path = save_checkpoint(self.save_dir, self.step, pol.chunks, pol.optimizer, state,
                               hf_source_dir=pol.model_dir, meta=meta,
                               save_optim=not t.no_save_optim, save_rng=not t.no_save_rng,
                               write_extra=self._save_extra)
        self._record_save(path, state["reward"], hf_copies=t.save_safetensors)
        logger.info(f"saved checkpoint {path}")
        if self.state.rank == 0:
            report = write_run_report(self.output_dir, self.args, self.plan, self.train_iters)
            self.report = report.summary if report else self.report

    def _record_save(self, path: str, reward: Optional[float], hf_copies: bool) -> None:
        """After the resumable checkpoint at `path`: its entry in best_checkpoint.json, the HF
        copies (when `hf_copies`), the rotation. Collective."""
        t = self.args.training
        run_checkpoint.on_rank0(lambda: run_checkpoint.record_best(self.save_dir, self.step,
                                                                   reward))
        if hf_copies:
            self._save_hf_copies(path)
        run_checkpoint.on_rank0(lambda: run_checkpoint.rotate(self.save_dir, t.save_total_limit))
        self._saved_step = self.step

    def _finish_interrupted_save(self, path: str, reward: Optional[float]) -> None:
        """A resume of this save directory's latest checkpoint: what a run stopped during that
        save (kill -9) may not have done after the checkpoint itself (the HF copies, the entry
        in best_checkpoint.json, the rotation) is done now. Collective."""
        missing = self.args.training.save_safetensors and not self._hf_copies_complete()
        if missing:
            logger.info(f"writing the HF copies of step {self.step}, which the run that saved "
                        f"{path} did not finish")
            run_checkpoint.on_rank0(self._remove_hf_copies)
        self._record_save(path, reward, hf_copies=missing)

    def _saved_with(self) -> dict:
        """The layout the optimizer state resumes in (checkpoint/start.py
        `check_resume_layout`), with the form of a fully trained MoE model's experts."""
        saved = {"tp": self.state.tp, "pp": self.state.pp, "ep": self.state.ep,
                 "etp": self.state.etp, **self.args.parallel.uneven_pipeline}
        if self.policy.config.num_moe_experts and self.args.training.train_type == "full":
            saved["grouped_experts"] = bool(self.policy.config.moe_grouped_gemm)
        return saved

    def _sampler_state(self) -> dict:
        """The sampler's state to resume from: with a batch prefetched, from before its draw
        (its generation is dropped, a resumed run generates it again)."""
        pending = self.prefetch.pending if self.prefetch else None
        return pending.sampler_state if pending else self.sampler.state_dict()

    def _save_hf_copies(self, path: str) -> None:
        """checkpoint-<step>: the HF weights (LoRA: the PEFT adapter, and the merged model in
        checkpoint-<step>-merged with --merge_lora; lora_llm: the merged model only, as
        ms-swift, since the adapter does not hold the trained vision tower). A failed write
        leaves neither; the error says that the resumable checkpoint `path` is complete."""
        pol, chunk = self.policy, self.policy.chunks[0]  # one chunk with LoRA
        directory = run_checkpoint.hf_dir(self.save_dir, self.step)
        merged = run_checkpoint.hf_dir(self.save_dir, self.step, merged=True)
        kept = f"the resumable checkpoint {path} is complete: {self._resume_hint()} resumes " \
               f"from it and writes {os.path.basename(directory)} again"
        shard = self.args.training.max_shard_size
        with removed_if_failed([directory, merged], directory, kept, self.state.rank == 0):
            if pol.lora is None:
                pol.bridge.save_hf(pol.chunks, directory, source_dir=pol.model_dir, exist_ok=True,
                                   max_shard_size=shard)
                return
            if self._adapter_alone:
                save_adapter(unwrap(chunk), directory, pol.model_dir, pol.lora, pol.bridge)
            if self.args.training.merge_lora:
                pol.bridge.save_hf(chunk, merged, source_dir=pol.model_dir, exist_ok=True,
                                   max_shard_size=shard)

    def _resume_hint(self) -> str:
        """The flags of a run that resumes this one's last checkpoint into its save directory
        (which finishes what a failed or killed save left undone: _finish_interrupted_save)."""
        return f"`--load {self.save_dir} --save {self.save_dir}`"

    def _hf_copies_complete(self) -> bool:
        """Whether every HF copy _save_hf_copies writes for this step is there (each directory
        is published whole; the adapter's config is written after its weights)."""
        directory = run_checkpoint.hf_dir(self.save_dir, self.step)
        if self.policy.lora is None:
            return os.path.isdir(directory)
        wanted = ([os.path.join(directory, ADAPTER_CONFIG)] if self._adapter_alone else []) + \
            ([run_checkpoint.hf_dir(self.save_dir, self.step, merged=True)]
             if self.args.training.merge_lora else [])
        return all(os.path.exists(path) for path in wanted)

    def _remove_hf_copies(self) -> None:
        for merged in (False, True):
            shutil.rmtree(run_checkpoint.hf_dir(self.save_dir, self.step, merged),
                          ignore_errors=True)

    def _resume(self, directory: str) -> Optional[dict]:
        """Load the checkpoint at `directory`; its trainer state (None: weights only)."""
        t, pol = self.args.training, self.policy
        state = load_checkpoint(directory, pol.chunks, pol.optimizer,
                                load_optim=not t.no_load_optim, load_rng=not t.no_load_rng)
        if state is None:
            logger.info(f"initialised the policy from {directory} (weights only)")
            return None
        self.step = int(state["step"])
        dropped = self.metrics_log.drop_after(self.step)
        if dropped:
            logger.info(f"logging.jsonl: removed {dropped} line(s) of steps after {self.step}")
        if self.args.grpo.sync_ref_model and self.reference.load(directory):
            logger.info(f"restored the synced reference model from {directory}")
        pol.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        logger.info(f"resumed from {directory} at step {self.step}")
        return state

    @property
    def _adapter_alone(self) -> bool:
        """Whether the adapter holds everything the run trains (--train_type lora; not
        lora_llm, which trains the vision tower too): then it is saved in PEFT format."""
        return self.args.training.train_type == "lora"

    def _save_extra(self, directory: str) -> None:
        """With LoRA, the adapter in PEFT format under directory/adapter; with --sync_ref_model,
        the reference weights under directory/ref_model (collective)."""
        pol = self.policy
        if self.args.grpo.sync_ref_model:
            self.reference.save(directory)
        if self._adapter_alone:
            save_adapter(unwrap(pol.chunks[0]), os.path.join(directory, "adapter"),
                         pol.model_dir, pol.lora, pol.bridge)

    def export_final(self) -> None:
        """The trained policy as an HF checkpoint: {output_dir}/final_hf (adapters merged), and
        with --train_type lora also the adapter in PEFT format: {output_dir}/final_adapter.
        Files the final save already wrote are hard-linked, not written twice. A failed write
        leaves neither."""
        final_hf = os.path.join(self.output_dir, "final_hf")
        final_adapter = os.path.join(self.output_dir, "final_adapter")
        kept = f"the checkpoint of step {self.step} is complete: {self._resume_hint()} resumes " \
               "from it and writes the final model"
        with removed_if_failed([final_hf, final_adapter], final_hf, kept, self.state.rank == 0):
            self._export_final(final_hf, final_adapter)

    def _export_final(self, final_hf: str, final_adapter: str) -> None:
        pol = self.policy
        merged = run_checkpoint.hf_dir(self.save_dir, self.step, merged=pol.lora is not None)
        if self._saved_step == self.step and os.path.isdir(merged):
            run_checkpoint.on_rank0(lambda: run_checkpoint.link_tree(merged, final_hf))
        else:
            pol.bridge.save_hf(pol.chunks, final_hf, source_dir=pol.model_dir, exist_ok=True,
                               max_shard_size=self.args.training.max_shard_size)
        if not self._adapter_alone:
            return
        adapter = run_checkpoint.hf_dir(self.save_dir, self.step)
        if self._saved_step == self.step and os.path.isdir(adapter):
            run_checkpoint.on_rank0(lambda: run_checkpoint.link_tree(adapter, final_adapter))
        else:
            save_adapter(unwrap(pol.chunks[0]), final_adapter, pol.model_dir, pol.lora,
                         pol.bridge)

    def _warn(self, message: Optional[str]) -> None:
        if message and self.state.rank == 0:
            logger.warning(message)

    def _run_end(self) -> RunEnd:
        """Where the run's model, checkpoints and report are (global rank 0, at its end)."""
        save_dir, step, finished = self.save_dir, self.step, self.step >= self.train_iters
        best = run_checkpoint.read_best(save_dir)
        return RunEnd(
            step=step, train_iters=self.train_iters, seconds=time.monotonic() - self.started,
            save_dir=save_dir, last=iteration_dir(save_dir, step), last_hf=self._hf_copy(step),
            final_model=existing(os.path.join(self.output_dir, "final_hf")) if finished else None,
            final_adapter=existing(os.path.join(self.output_dir, "final_adapter"))
            if finished else None,
            best=best, best_path=best and (self._hf_copy(best["step"])
                                           or existing(iteration_dir(save_dir, best["step"]))),
            report=self.report)

    def _hf_copy(self, step: int) -> Optional[str]:
        """The HF copy of save `step` (LoRA: the merged model, else the adapter), if written."""
        return existing(run_checkpoint.hf_dir(self.save_dir, step, merged=True),
                        run_checkpoint.hf_dir(self.save_dir, step))

    def close(self) -> None:
        if self.prefetch:
            self.prefetch.close()
        self.metrics_log.close()
        self.completions_log.close()
        self.engine.close()
        self.state.destroy()
        self.run_lock.release()


def run_grpo(args: RlhfArguments, plan: BatchPlan) -> Dict[str, float]:
    return GRPOTrainer(args, plan).train()
