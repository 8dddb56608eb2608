"""The first-step numerics gate (--numerics_check, pure): before the run's first optimizer step,
the mean |engine - trainer| logprob of the first rollout batch's completion tokens (the loss's
`rollout/logprob_abs_diff_mean`, computed from numbers the step already has: no extra pass)
against a tolerance per model kind. Past it the run stops before any update, naming the family,
the gap and what to try.

Tolerances: about 2-4x the bfloat16 gaps measured between vLLM and the trainer on the same
weights (docs/gpu.md's gate table, docs/export.md), at temperature 1:
- dense (Llama/Qwen2/Qwen3, and the VL models' text stacks): 0.0097-0.0119 on H200 -> 0.05;
- hybrid Gated DeltaNet (Qwen3.5): 0.022-0.024 on H200, 0.017-0.031 on the CPU -> 0.1;
- MoE (Qwen3-MoE, Qwen3.5-MoE): random routers flip bf16 near-ties, 0.11-0.24 on H200 at real
  width -> 0.5 (trained routers have margins and stay lower).
A broken weight mapping or a wrong dtype gives gaps of order 1.
"""
from typing import Optional

TOLERANCES = {"dense": 0.05, "hybrid": 0.1, "moe": 0.5}
GAP_METRIC = "rollout/logprob_abs_diff_mean"   # objective.py's engine vs trainer gap


def sampling_skip(top_p: float, top_k: int, repetition_penalty: float) -> Optional[str]:
    """Why the engine's logprobs are not the trainer's distribution whatever the numerics, or
    None: vLLM reports the logprobs of the distribution it sampled from, which top-k / top-p
    filtering renormalises and a repetition penalty reshapes (the trainer applies the
    temperature only)."""
    changed = [flag for flag, on in (("--top_p", top_p < 1), ("--top_k", top_k > 0),
                                     ("--repetition_penalty", repetition_penalty != 1)) if on]
    if not changed:
        return None
    return (f"numerics check skipped: with {' and '.join(changed)} the engine's logprobs are of "
            "the distribution it sampled from, not the trainer's")


def model_kind(num_experts: Optional[int], hybrid: bool) -> str:
    """The tolerance row of a model: "moe" (any experts), "hybrid" (Gated DeltaNet), "dense"."""
    if num_experts:
        return "moe"
    return "hybrid" if hybrid else "dense"


def tolerance(kind: str, atol: Optional[float]) -> float:
    """--numerics_check_atol when set, else the kind's measured-gap tolerance."""
    return TOLERANCES[kind] if atol is None else atol


def gate_failure(gap: float, model_type: str, kind: str, atol: Optional[float]) -> Optional[str]:
    """The error message when gap exceeds the tolerance (or is not finite), else None."""
    limit = tolerance(kind, atol)
    if gap <= limit:
        return None
    source = "--numerics_check_atol" if atol is not None else f"the {kind} tolerance"
    return (f"numerics check (before the first optimizer step): the trainer's logprobs of the "
            f"first rollout batch differ from the rollout engine's by {gap:.4g} on average per "
            f"completion token ({model_type}, {kind} model), past {source} {limit:g}. The "
            "engine does not compute what the trainer computes: check that both run the same "
            "weights and dtype (--torch_dtype; --vllm_engine_kwargs), that a quantized engine "
            "or changed kernels are intended, and that the checkpoint "
            "converts cleanly (`megatron export --test_convert_precision true`). A known, "
            "accepted gap: raise --numerics_check_atol (correct for it with "
            "--rollout_importance_sampling_mode) or pass --numerics_check false.")
