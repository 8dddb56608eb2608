"""Mixture-of-experts flags of ms-swift's Megatron mode (names, defaults and meanings as
ms-swift's `moe_*` group) and `--router_replay_mode` (ms-swift's routing replay, R2 / R3).

Every flag here acts on MoE models only: a non-default value on a model without experts is an
error before anything loads (`check_moe_flags`, with the HF config). `config_overrides` turns
the flags into megatron-core TransformerConfig settings (model/config.py applies them over the
HF config's own for the policy and for every reference or teacher model with experts). The
routing replay itself is model/routing_replay.py.
"""
from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, List, Mapping, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")
# the load-balancing type ms-swift's model config gives the supported families (Qwen3-MoE,
# Qwen3.5-MoE: config.json names none; mcore-bridge's ModelConfig default)
DEFAULT_LOAD_BALANCING = "aux_loss"
# accepted, not refused: ms-swift's Qwen3.5-35B-A3B GRPO example passes it
_TE_PERMUTE = ("Transformer Engine's fused token permutation; swift-megatron does not use "
               "Transformer Engine, and permutes tokens with torch operations")


@dataclass
class MoeArguments:
    """Mixture of experts (MoE models only; ms-swift's names)"""

    moe_router_load_balancing_type: Optional[List[str]] = arg(
        None, "Load balancing of the router, one or several of aux_loss (GShard / Switch "
        "Transformer, per micro-batch), seq_aux_loss (per sequence, DeepSeek-V2/V3), "
        "global_aux_loss (over the global batch), sinkhorn (S-BASE: training routes by "
        "Sinkhorn-normalised scores), none; the aux losses act only with a "
        "--moe_aux_loss_coeff > 0. Default: the model config's (aux_loss for Qwen3-MoE and "
        "Qwen3.5-MoE, as ms-swift).", choices=list(LOAD_BALANCING_TYPES))
    moe_aux_loss_coeff: List[float] = arg(
        [0.0], "Coefficient of the load-balancing loss, one per --moe_router_load_balancing_type "
        "entry (0: no aux loss). Logged per step as moe/load_balancing_loss, "
        "moe/seq_load_balancing_loss or moe/global_load_balancing_loss (the loss before the "
        "coefficient, mean over layers and micro-batches).")
    moe_z_loss_coeff: Optional[float] = arg(
        None, "Coefficient of the router z-loss (ST-MoE: mean squared log-sum-exp of the router "
        "logits), logged as moe/z_loss. Default: none (no z-loss).")
    moe_router_dtype: str = arg("fp32", "Precision of the routing (softmax, top-k) and of the "
                                "experts' weighted sum: fp32, fp64, or none (the model's "
                                "dtype).", choices=["none", "fp32", "fp64"])
    moe_shared_expert_overlap: bool = arg(
        False, "Run the shared expert (Qwen3.5-MoE) while the routed experts' tokens are "
        "dispatched, instead of before the router (megatron-core's overlap; alltoall "
        "dispatcher).")
    moe_expert_capacity_factor: Optional[float] = arg(
        None, "Capacity of each expert as a multiple of its even share of the micro-batch's "
        "token-expert assignments; assignments past it are dropped (--moe_token_drop_policy). "
        "Default: none (no dropping).")
    moe_pad_expert_input_to_capacity: bool = arg(
        False, "With --moe_expert_capacity_factor: pad every expert's tokens to its capacity "
        "(fixed shapes).")
    moe_token_drop_policy: str = arg(
        "probs", "Which assignments past an expert's capacity are dropped: probs (the lowest "
        "router probability first) or position (the last tokens of the micro-batch).",
        choices=["probs", "position"])
    moe_permute_fusion: bool = arg(False, "Fused MoE token permutation.", no_effect=_TE_PERMUTE)
    router_replay_mode: str = arg(
        "disabled", "MoE routing replay: disabled; R2, every forward of the policy after the "
        "old-policy pass routes each token to the experts that pass chose (from the second "
        "optimizer step of a rollout batch on, or every step with --num_iterations > 1); R3, "
        "every forward of the policy routes each prompt and completion token to the experts "
        "the rollout engine chose when it generated them (vLLM's routed experts, or the "
        "embedded engine's).", choices=list(ROUTER_REPLAY_MODES))

    def __post_init__(self):
        if self.moe_router_load_balancing_type is not None:   # the parser reads "none" as None
            self.moe_router_load_balancing_type = [kind or "none" for kind in
                                                   self.moe_router_load_balancing_type]
        if any(c < 0 for c in self.moe_aux_loss_coeff) or not self.moe_aux_loss_coeff:
            raise UserError(f"--moe_aux_loss_coeff must be one or more numbers >= 0, got "
                            f"{self.moe_aux_loss_coeff}")
        for name in ("moe_z_loss_coeff", "moe_expert_capacity_factor"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name} must be > 0, got {value} (leave it unset to turn "
                                "it off)")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise UserError("--moe_pad_expert_input_to_capacity true pads to the capacity that "
                            "--moe_expert_capacity_factor sets: pass that too")
        check_load_balancing(self.load_balancing_types, self.moe_aux_loss_coeff)
        if self.moe_expert_capacity_factor is not None and "sinkhorn" in self.load_balancing_types:
            raise UserError("--moe_expert_capacity_factor does not combine with "
                            "--moe_router_load_balancing_type sinkhorn (megatron-core drops "
                            "tokens after top-k routing only)")
        if self.router_replay_mode != "disabled" and "sinkhorn" in self.load_balancing_types:
            raise UserError(f"--router_replay_mode {self.router_replay_mode} replays top-k "
                            "routing; --moe_router_load_balancing_type sinkhorn routes without "
                            "it: choose one")

    @property
    def load_balancing_types(self) -> List[str]:
        return list(self.moe_router_load_balancing_type or [DEFAULT_LOAD_BALANCING])

    @property
    def replays_routes(self) -> bool:
        return self.router_replay_mode != "disabled"

    def config_overrides(self) -> Dict[str, Any]:
        """The TransformerConfig settings of these flags (megatron's names; a single type or
        coefficient as a scalar, as ms-swift passes them). Pure."""
        types, coeffs = self.load_balancing_types, list(self.moe_aux_loss_coeff)
        overrides: Dict[str, Any] = dict(
            moe_router_load_balancing_type=types[0] if len(types) == 1 else types,
            moe_aux_loss_coeff=coeffs[0] if len(coeffs) == 1 else coeffs,
            moe_z_loss_coeff=self.moe_z_loss_coeff,
            moe_router_dtype=None if self.moe_router_dtype == "none" else self.moe_router_dtype,
            moe_shared_expert_overlap=self.moe_shared_expert_overlap,
            moe_token_drop_policy=self.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=self.moe_pad_expert_input_to_capacity)
        if self.moe_expert_capacity_factor is not None:
            overrides["moe_expert_capacity_factor"] = self.moe_expert_capacity_factor
        return overrides


def check_load_balancing(types: List[str], coeffs: List[float]) -> None:
    """One coefficient, or one per load-balancing type; a positive one only on an aux-loss
    type (megatron-core would ignore it on none and refuses it with sinkhorn). Pure."""
    if len(coeffs) > 1 and len(coeffs) != len(types):
        raise UserError(f"--moe_aux_loss_coeff gives {len(coeffs)} coefficients for "
                        f"{len(types)} --moe_router_load_balancing_type entries ({types}): give "
                        "one per type")
    if len(types) > 1 and len(coeffs) == 1:
        raise UserError(f"--moe_router_load_balancing_type {' '.join(types)}: give one "
                        "--moe_aux_loss_coeff per type, in the same order")
    for kind, coeff in zip(types, coeffs * len(types) if len(coeffs) == 1 else coeffs):
        if coeff > 0 and kind not in AUX_LOSS_TYPES:
            raise UserError(f"--moe_aux_loss_coeff {coeff} for --moe_router_load_balancing_type "
                            f"{kind}: a coefficient applies to {', '.join(AUX_LOSS_TYPES)} "
                            "only (0 for the others)")


def check_moe_flags(moe: MoeArguments, explicit, hf_text_config: Mapping,
                    experts: Optional[int]) -> None:
    """UserError for MoE flags set to a non-default value on a model without experts (each
    would do nothing), and for a shared-expert overlap on a model without a shared expert."""
    given = [f"--{f.name}" for f in fields(MoeArguments) if f.name in explicit
             and not f.metadata.get("no_effect") and getattr(moe, f.name) != _default(f)]
    model_type = hf_text_config.get("model_type")
    if given and not experts:
        raise UserError(f"{', '.join(given)}: MoE flag{'s' if len(given) > 1 else ''}, and this "
                        f"{model_type} model has no experts (drop "
                        f"{'them' if len(given) > 1 else 'it'})")
    if moe.moe_shared_expert_overlap and not hf_text_config.get("shared_expert_intermediate_size"):
        raise UserError("--moe_shared_expert_overlap true overlaps the shared expert with the "
                        f"dispatch; this {model_type} model has no shared expert (drop the flag)")


def _default(field):
    return field.default_factory() if field.default is MISSING else field.default
