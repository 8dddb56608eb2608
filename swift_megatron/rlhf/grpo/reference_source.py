"""Which frozen reference model GRPO's KL term uses, read off the flags alone (no model, no
megatron-core import, so the dry run can check the paths): see rlhf/grpo/references.py for the
rules and the model that computes the reference logprobs."""
import dataclasses
from typing import Optional

from swift_megatron.checkpoint.sources import (AdapterSource, WeightsSource, adapter_source,
                                               mcore_source)
from swift_megatron.errors import UserError


@dataclasses.dataclass(frozen=True)
class ReferenceSource:
    """Where a frozen reference model's weights come from."""

    weights: Optional[WeightsSource]   # its base weights (None: the HF checkpoint at model_dir)
    adapter: Optional[AdapterSource]   # an adapter to apply on them
    model_name: Optional[str] = None   # --ref_model (an HF directory or hub id)


def _adapter(grpo) -> Optional[AdapterSource]:
    if grpo.ref_adapters and grpo.mcore_ref_adapter:
        raise UserError("pass --ref_adapters or --mcore_ref_adapter, not both")
    if grpo.ref_adapters:
        return adapter_source(grpo.ref_adapters[0], "--ref_adapters")
    if grpo.mcore_ref_adapter:
        return adapter_source(grpo.mcore_ref_adapter, "--mcore_ref_adapter")
    return None


def reference_source(grpo, lora: bool, policy_weights: Optional[WeightsSource]
                     ) -> Optional[ReferenceSource]:
    """The frozen reference to load, or None when GRPOArguments.has_frozen_reference says there
    is none. Without --ref_model / --mcore_ref_model it has the policy's starting weights
    (`policy_weights`, or the policy's --model)."""
    if not grpo.has_frozen_reference(lora):
        return None
    if grpo.mcore_ref_model:
        return ReferenceSource(mcore_source(grpo.mcore_ref_model, "--mcore_ref_model"),
                               _adapter(grpo))
    if grpo.ref_model:
        return ReferenceSource(None, _adapter(grpo), grpo.ref_model)
    return ReferenceSource(policy_weights, _adapter(grpo))
