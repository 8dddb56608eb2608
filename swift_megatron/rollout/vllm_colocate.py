"""Colocate mode: a vLLM engine inside every training process (`--vllm_mode colocate`).

Each training process builds an in-process `LLM` (engine core in the process,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`). With `--vllm_tensor_parallel_size T > 1`, T consecutive
training ranks form one vLLM TP group through vLLM's `external_launcher` executor (one engine per
torchrun process, all of them running the same requests in lockstep); that group is independent
of the Megatron layout. `generate` all-gathers the group's requests, every member generates all
of them, and each rank keeps its own share, in order.

Seeds (`request_seeds`): True gives every request its own seed (`SamplingParams(seed=...)`), so
a sample depends on its seed alone, whichever batch or process generates it; vLLM then draws
each seeded request's noise with its own generator, one kernel per request and decode step
(its sampler's slow path). False (`--vllm_request_seeds false`) seeds vLLM's batched draw
once per call instead, from the call's seeds (`batch_seed`), inside a fork of
torch's RNG state: the same requests in the same order sample the same tokens on every member of
a TP group and in a rerun, and the trainer's RNG stream is left as it was.

Weights: the engine starts with `load_format="dummy"` (random weights, nothing read from disk)
because the trainer pushes the policy with `update_weights` before the first rollout.
`update_weights` streams the bridge's export in buckets into the model's `load_weights` (see
weight_sync.py), then resets the prefix cache and bumps `weight_version`.

Memory hand-over (`--sleep_level`): `sleep()` after generation releases the KV cache and
offloads (1) or discards (2) the weights; `update_weights` wakes the weights only, `wake_up()`
the rest before the next generation. With `full_syncs` (every `update_weights` sends every
weight, as GRPO's does unless it leaves a frozen vision tower out) a level-1 sleep discards the
weights too: the host copy vLLM's level 1 keeps would be overwritten by the next update before
anything read it, and copying 3 GB out at every sleep and back at every sync cost 0.3-0.5 s per
rollout batch at 1.5B (docs/gpu.md). After a discarding sleep the engine holds no weights
(`weights_discarded`) until the next `update_weights`: waking it before that raises, since vLLM
would generate from whatever the re-mapped memory holds (a GRPO run measured 0.67 mean logprob
mismatch that way, docs/gpu.md); the trainer pushes again when a discarding sleep followed its
sync (e.g. after --check_weight_sync's generation). On the CPU vLLM has no sleep mode: the
calls are accepted and change nothing. On CUDA, `allocated_while_asleep` is the part of torch's
allocated-memory counter the sleeping engine still holds (what it allocated at construction
less what a sleep took off the counter): per-phase peaks minus it are the training's own
memory.

Between vLLM's engine steps (vllm_compat.finished_requests) every call learns which requests
finished: a GenerationClock times the call and its tail (`generation_times`, timeline.py), and
`generate(..., on_finished=...)` hands this rank's finished completions to the trainer while
the others still decode (--tail_logprobs, rlhf/grpo/tail.py). With --async_generate the calls
come from the trainer's background thread (rlhf/grpo/prefetch.py).

    engine = ColocateEngine(ColocateSettings(model_dir, dtype="float32", ...), eos_token_ids=[...])
    engine.update_weights(bridge.export(model)); engine.generate(prompts, sampling, seeds)

Images (a vision-language model): `generate(..., images=[...])` gives each request None or its
prompt's encoded images (data/images.py); vLLM gets the PIL images as `multi_modal_data` and
runs its own processor on them, with the prompt's tokens holding ONE `<|image_pad|>` per image:
vLLM expands each pad itself (given our already expanded run it expands the first pad again).
"""
import contextlib
import dataclasses
import functools
import hashlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from swift_megatron.data.images import one_pad_per_image
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.model.config import load_hf_config
from swift_megatron.rollout import vllm_compat
from swift_megatron.rollout.engine import Completion, SamplingConfig, default_seeds
from swift_megatron.rollout.timeline import GenerationClock, GenerationTimes
from swift_megatron.rollout.weight_sync import WORKER_EXTENSION, iter_buckets

logger = get_logger(__name__)
OnFinished = Callable[[List[Tuple[int, Completion]]], None]   # see ColocateEngine._step_report


@dataclasses.dataclass
class ColocateSettings:
    model_dir: str
    dtype: str = "bfloat16"
    seed: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    disable_cascade_attn: bool = False
    sleep_level: int = 0
    full_syncs: bool = False   # every update_weights sends every weight (module docstring)
    request_seeds: bool = True  # one vLLM seed per request, else one per call (module docstring)
    routed_experts: bool = False   # each completion carries its routed experts (R3)
    bucket_bytes: int = 512 << 20
    engine_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)


def batch_seed(seeds: Sequence[int]) -> int:
    """One seed for a generate call, from its requests' seeds in order. Pure."""
    digest = hashlib.sha256(",".join(map(str, seeds)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


@contextlib.contextmanager
def seeded_rng(seed: int):
    """torch's RNGs (host and this process's GPU, what vLLM's batched sampler draws from) seeded
    with `seed` inside the block, and restored after it."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        yield


def _allocated() -> int:
    """torch's allocated bytes on this process's GPU (0 without CUDA)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _tp_group(size: int):
    """The gloo group of this rank's vLLM TP group (consecutive ranks), None for size 1.
    Collective: every training rank calls it."""
    if size == 1:
        return None
    world = dist.get_world_size()
    if world % size:
        raise UserError(f"--vllm_tensor_parallel_size {size} must divide the world size {world}")
    group, _ = dist.new_subgroups(group_size=size, backend="gloo")
    return group


class ColocateEngine:
    """The RolloutEngine of colocate mode (see the module docstring)."""

    def __init__(self, settings: ColocateSettings, eos_token_ids: Sequence[int]):
        self.settings = settings
        self.eos = list(eos_token_ids)
        self.weight_version = 0
        self.sync_position = "loading the weights into the colocated vLLM engine"
        if settings.tensor_parallel_size > 1 and not dist.is_initialized():
            raise UserError("--vllm_tensor_parallel_size > 1 in colocate mode needs the training "
                            "processes (launch with NPROC_PER_NODE)")
        self.group = _tp_group(settings.tensor_parallel_size) if dist.is_initialized() else None
        before = _allocated()
        self.llm = self._build()
        self._built_bytes = _allocated() - before
        self.allocated_while_asleep: Optional[int] = None   # CUDA, after the first sleep()
        self.image_token_id = load_hf_config(settings.model_dir).get("image_token_id")
        self._asleep: List[str] = []  # memory kinds released by sleep(): "weights", "kv_cache"
        self.weights_discarded = False  # a discarding sleep since the last update_weights
        self.generation_times: List[GenerationTimes] = []   # per generate call (timeline.py)

    def _build(self):
        s = self.settings
        engine = vllm_compat.EngineSettings(
            model=s.model_dir, dtype=s.dtype, seed=s.seed,
            tensor_parallel_size=s.tensor_parallel_size,
            gpu_memory_utilization=s.gpu_memory_utilization, max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs, enforce_eager=s.enforce_eager,
            enable_prefix_caching=s.enable_prefix_caching, sleep_level=s.sleep_level,
            disable_cascade_attn=s.disable_cascade_attn,
            load_format="dummy", external_launcher=dist.is_initialized(),
            worker_extension_cls=WORKER_EXTENSION, routed_experts=s.routed_experts,
            extra=dict(s.engine_kwargs))
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # vLLM seeds the global RNGs
            llm = vllm_compat.create_llm(engine)
        logger.info(f"vLLM {'.'.join(map(str, vllm_compat.version()))} colocate engine ready "
                    f"(TP {s.tensor_parallel_size}, sleep level {s.sleep_level})")
        return llm

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seeds: Optional[Sequence[int]] = None,
                 images: Optional[Sequence[Optional[dict]]] = None,
                 on_finished: Optional[OnFinished] = None) -> List[Completion]:
        """RolloutEngine.generate; `on_finished` (see `_step_report`) hears, between engine
        steps, of this rank's requests that finished."""
        seeds = list(seeds) if seeds is not None else default_seeds(sampling, len(prompts))
        pictures = [None if i is None else i["images"] for i in images or [None] * len(prompts)]
        all_prompts, all_seeds, all_pictures, mine = self._gather(list(map(list, prompts)), seeds,
                                                                  pictures)
        if not all_prompts:
            return []
        per_request = self.settings.request_seeds
        params = [vllm_compat.sampling_params(
            sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
            sampling.repetition_penalty, seed if per_request else None, self.eos)
            for seed in all_seeds]
        inputs = vllm_compat.prompt_inputs(all_prompts)
        for request, picture in zip(inputs, all_pictures):
            if picture:
                request["prompt_token_ids"] = one_pad_per_image(request["prompt_token_ids"],
                                                                self.image_token_id)
                request["multi_modal_data"] = {"image": picture}
        clock = GenerationClock(len(inputs))
        report = functools.partial(self._step_report, clock, mine, on_finished)
        with contextlib.nullcontext() if per_request else seeded_rng(batch_seed(all_seeds)), \
                vllm_compat.finished_requests(self.llm, report):
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        self.generation_times += [clock.times()] if clock.finishes else []
        routes = self._routes(outputs)
        return [self._completion(out, route) for out, route in zip(outputs[mine], routes[mine])]

    def _completion(self, output, route=None) -> Completion:
        return Completion(*vllm_compat.completion_fields(output), self.weight_version, route)

    def _own_route(self, output):
        """The output's routed experts where this rank has them (None unless asked for)."""
        return vllm_compat.routed_experts(output) if self.settings.routed_experts else None

    def _routes(self, outputs) -> list:
        """Each output's routed experts (None unless asked for); vLLM hands them to the first
        rank of its TP group only, which sends them to the others."""
        routes = [self._own_route(out) for out in outputs]
        if self.settings.routed_experts and self.group is not None:
            box = [routes]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
            routes = box[0]
        return routes

    def _step_report(self, clock: GenerationClock, mine: slice, on_finished: Optional[OnFinished],
                     done: List[Tuple[int, Any]]) -> None:
        """After each engine step: the clock learns how many requests finished (the whole vLLM
        TP group's), and `on_finished` gets [(index among this rank's prompts, Completion)] of
        its own that finished in the step (possibly none): it runs between two engine steps
        (rlhf/grpo/tail.py uses it)."""
        clock.step(len(done))
        if on_finished is not None:
            on_finished([(index - mine.start, self._completion(out, self._own_route(out)))
                         for index, out in done if mine.start <= index < mine.stop])

    def take_generation_times(self) -> List[GenerationTimes]:
        """The times of the generate calls since the last take (timeline.py)."""
        times, self.generation_times = self.generation_times, []
        return times

    def _gather(self, prompts: List[List[int]], seeds: List[int], pictures: List
                ) -> Tuple[List[List[int]], List[int], List, slice]:
        """Every request (prompt, seed, images) of this rank's vLLM TP group, and the slice that
        is this rank's."""
        if self.group is None:
            return prompts, seeds, pictures, slice(0, len(prompts))
        parts = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, (prompts, seeds, pictures), group=self.group)
        start = sum(len(part[0]) for part in parts[:dist.get_rank(self.group)])
        return ([p for part in parts for p in part[0]], [s for part in parts for s in part[1]],
                [i for part in parts for i in part[2]], slice(start, start + len(prompts)))

    # ---- weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._asleep:
            vllm_compat.wake_up(self.llm, ["weights"])
            self._asleep.remove("weights")
        for bucket, last in iter_buckets(named_tensors, self.settings.bucket_bytes):
            self.llm.collective_rpc("weight_sync_load", args=(bucket, last))
        self.llm.reset_prefix_cache()
        self.weight_version += 1
        self.weights_discarded = False

    # ---- memory hand-over ------------------------------------------------------------------
    def sleep(self) -> None:
        if self.settings.sleep_level == 0 or self._asleep:
            return
        before = _allocated()
        discard = self.settings.sleep_level == 2 or self.settings.full_syncs
        vllm_compat.sleep(self.llm, 2 if discard else 1)
        self._asleep = ["weights", "kv_cache"]
        self.weights_discarded = discard
        if torch.cuda.is_available() and self.allocated_while_asleep is None:
            self.allocated_while_asleep = self._built_bytes - (before - _allocated())

    def wake_up(self) -> None:
        if self.weights_discarded:
            raise RuntimeError("the colocate engine's weights were discarded by its last sleep: "
                               "update_weights must come before wake_up")
        if self._asleep:
            vllm_compat.wake_up(self.llm, list(self._asleep))
            self._asleep = []

    def abandon(self) -> None:
        return None   # it holds nothing outside this process

    def close(self) -> None:
        if self.llm is not None:
            self.llm = None
            vllm_compat.release_engine()
        self.group = None
