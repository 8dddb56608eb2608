"""Choose and build the trainer's rollout engine from the flags: the embedded transformers engine
(hf.py), vLLM in every training process (vllm_colocate.py) or remote `megatron rollout` servers
(client.py). The trainer wires one call:

    engine = build_engine(args, model_dir=..., device=..., dtype=..., eos_token_ids=[...],
                          pad_token_id=...)

Every training rank calls it at the same point (the vLLM engines create process groups).
With --router_replay_mode R3 every engine returns each completion's routed experts (a rollout
server must have been started returning them: rollout/client.py checks). Whether vLLM is
used: `--use_vllm`, by default true in server mode and, in colocate mode, when
vLLM is installed and training runs on CUDA (on a CPU, vLLM is opt-in with `--use_vllm true`).
"""
from typing import Any, Dict, Optional, Sequence

import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.errors import UserError
from swift_megatron.platform import vllm_installed
from swift_megatron.rollout.engine import RolloutEngine


def engine_kind(args: RlhfArguments, device: torch.device) -> str:
    """"hf", "colocate" or "server"."""
    if not args.rollout.vllm_enabled(vllm_installed(), device.type == "cuda"):
        return "hf"
    return args.rollout.vllm_mode


def vision_engine_kwargs(model_dir: str, max_pixels: Optional[int], dummy_weights: bool,
                         images: Optional[bool] = None) -> Dict[str, Any]:
    """vLLM engine arguments of a vision-language model (--vllm_engine_kwargs wins):
    `mm_processor_kwargs` max_pixels as the trainer's (--max_pixels / MAX_PIXELS), and with
    `dummy_weights` (the colocated engine) `mm_device_do_normalize=False` where vLLM has it
    (0.32): that option's normalisation buffers (`visual.input_norm`) are no checkpoint tensor,
    so no weight sync would ever fix their random values. A Qwen3.5 engine starts its language
    model only (vllm_compat.model_defaults) unless `images`: whether the run's prompts hold
    images (the trainer knows its dataset), or None for "whenever the checkpoint takes images"
    (a rollout server, which cannot know its requests)."""
    import dataclasses

    from swift_megatron.model.config import load_hf_config
    from swift_megatron.model.vision import OPTIONAL_TOWER, has_vision, takes_images

    hf_config = load_hf_config(model_dir)
    if not has_vision(hf_config):
        return {}
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs: Dict[str, Any] = {}
    if max_pixels is not None:
        kwargs["mm_processor_kwargs"] = {"max_pixels": max_pixels}
    if dummy_weights and "mm_device_do_normalize" in fields:
        kwargs["mm_device_do_normalize"] = False
    if images is None:
        images = takes_images(model_dir, hf_config)
    if images and hf_config["model_type"] in OPTIONAL_TOWER and "language_model_only" in fields:
        kwargs["language_model_only"] = False
    return kwargs


def build_engine(args: RlhfArguments, *, model_dir: str, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: Sequence[int], pad_token_id: int,
                 images: bool = False, full_syncs: bool = False) -> RolloutEngine:
    """The engine the flags ask for (see the module docstring); `images`: whether the run's
    prompts hold images (a Qwen3.5 vLLM engine then starts with its vision tower);
    `full_syncs`: every weight sync sends every weight (a colocate engine then discards its
    weights at a level-1 sleep too, vllm_colocate.py)."""
    kind = engine_kind(args, device)
    bucket_bytes = args.rollout.weight_sync_bucket_mb << 20
    routes = args.moe.router_replay_mode == "R3"   # completions carry their routed experts
    if kind == "hf":
        from swift_megatron.rollout.hf import HFEngine

        return HFEngine(model_dir, device, dtype, eos_token_ids, pad_token_id,
                        routed_experts=routes,
                        attn_implementation=args.model.attn_implementation)
    if kind == "server":
        from swift_megatron.rollout.client import ServerEngine

        from swift_megatron.model.config import load_hf_config

        return ServerEngine(args.rollout.server_addresses(), eos_token_ids,
                            timeout=args.rollout.vllm_server_timeout, bucket_bytes=bucket_bytes,
                            device=device, api_key=args.rollout.vllm_server_api_key,
                            image_token_id=load_hf_config(model_dir).get("image_token_id"),
                            routed_experts=routes)
    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

    v = args.vllm
    from swift_megatron.data.images import resolve_max_pixels

    engine_kwargs = {**vision_engine_kwargs(model_dir, resolve_max_pixels(args.data.max_pixels),
                                            dummy_weights=True, images=images),
                     **(v.vllm_engine_kwargs or {})}
    if images and engine_kwargs.get("language_model_only"):
        raise UserError("--vllm_engine_kwargs language_model_only=true starts vLLM without the "
                        "vision tower, but the dataset holds images: drop that key")
    settings = ColocateSettings(
        model_dir=model_dir, dtype=str(dtype).replace("torch.", ""), seed=args.training.seed,
        tensor_parallel_size=v.vllm_tensor_parallel_size,
        gpu_memory_utilization=v.vllm_gpu_memory_utilization,
        max_model_len=v.vllm_max_model_len or args.data.max_length,
        max_num_seqs=v.vllm_max_num_seqs, enforce_eager=v.vllm_enforce_eager,
        enable_prefix_caching=v.vllm_enable_prefix_caching, sleep_level=args.rollout.sleep_level,
        disable_cascade_attn=v.vllm_disable_cascade_attn,
        full_syncs=full_syncs, request_seeds=args.rollout.vllm_request_seeds,
        routed_experts=routes, bucket_bytes=bucket_bytes, engine_kwargs=engine_kwargs)
    return ColocateEngine(settings, eos_token_ids)
