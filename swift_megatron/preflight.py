"""Every check of an rlhf command that needs no model weights and no heavy import.

Runs before any process is launched or model built: the batch plan for the world size that
will run, and, when --model is a readable local directory, the model-dependent rules (experts
vs EP, heads vs TP, layers vs PP). `--dry_run true` prints what this returns.
"""
import importlib.util
import json
import os
from typing import Optional, Tuple

from swift_megatron.arguments.batch_plan import BatchPlan, make_batch_plan
from swift_megatron.arguments.commands import RlhfArguments, batch_inputs
from swift_megatron.errors import UserError
from swift_megatron.parallel.layout import check_layout, num_experts


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def uses_vllm(args: RlhfArguments) -> bool:
    """--use_vllm or its default (rollout/factory.py has the same rule), judged before any
    torch import: CUDA is assumed unless --device cpu."""
    return args.rollout.vllm_enabled(vllm_installed(), args.model.device != "cpu")


def read_local_hf_config(model: Optional[str]) -> Optional[dict]:
    """config.json of a local model directory, or None for hub ids / missing paths."""
    if not model or not os.path.isdir(model):
        return None
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--model {model}: no config.json in that directory")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise UserError(f"--model {model}: config.json is not valid JSON ({exc})") from None


def preflight_rlhf(args: RlhfArguments, world_size: int) -> Tuple[BatchPlan, Optional[dict]]:
    """The batch plan and (when readable) the model's HF config; raises UserError on any rule."""
    hf_config = read_local_hf_config(args.model.model)
    experts = num_experts(hf_config) if hf_config else None
    colocate = uses_vllm(args) and args.rollout.vllm_mode == "colocate"
    plan = make_batch_plan(batch_inputs(args, world_size, experts, colocate))
    if hf_config:
        p = args.parallel
        check_layout(hf_config, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                     p.expert_model_parallel_size, p.expert_tensor_parallel_size)
        if experts and p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
            raise UserError("a MoE model with --tensor_model_parallel_size > 1 needs "
                            "--sequence_parallel true (megatron-core refuses to train MoE with "
                            "TP but without sequence parallelism)")
    return plan, hf_config
