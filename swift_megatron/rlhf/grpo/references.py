"""The reference model of GRPO's KL term (needed when --beta > 0), as ms-swift's flags choose it:

- full training: a frozen copy of the starting weights (--model / --mcore_model);
- LoRA: the policy itself with its adapters disabled (no second model in memory);
- another reference: --ref_model (an HF directory or hub id) or --mcore_ref_model (a Megatron
  checkpoint of ours), and/or an adapter on it, --ref_adapters (PEFT) or --mcore_ref_adapter (a
  LoRA checkpoint of ours): a frozen model of its own, whatever --train_type. It may be another
  size of a supported family as long as it shares the policy's tokenizer.

--sync_ref_model (TR-DPO) moves the frozen reference towards the policy every
--ref_model_sync_steps optimizer steps, ref = alpha * policy + (1 - alpha) * ref; those weights
are part of the training state: each checkpoint saves them under ref_model/ and resume loads them.
"""
import dataclasses
import os
from typing import Callable, List, Optional

import torch

from swift_megatron.checkpoint.dist import load_model, save_model, unwrap
from swift_megatron.checkpoint.layout import hf_dir
from swift_megatron.checkpoint.trainer import resolve_load_dir
from swift_megatron.errors import UserError
from swift_megatron.lora import disabled
from swift_megatron.training.step import forward_backward

REF_DIR = "ref_model"  # inside a checkpoint directory, with --sync_ref_model


@dataclasses.dataclass(frozen=True)
class ReferenceSource:
    """Where a frozen reference model's weights come from."""

    model_dir: str                   # HF directory: config (and weights unless weights_dir)
    weights_dir: Optional[str]       # a Megatron model directory with the weights
    adapter_dir: Optional[str]       # a PEFT adapter to apply


def _checkpoint(flag: str, path: str) -> str:
    if not os.path.isdir(path):
        raise UserError(f"--{flag} {path}: no such directory")
    try:
        return resolve_load_dir(path)
    except UserError as error:
        raise UserError(f"--{flag} {path}: {error}") from None


def _adapter_dir(grpo) -> Optional[str]:
    if grpo.ref_adapters:
        return grpo.ref_adapters[0]
    if grpo.mcore_ref_adapter:
        adapter = os.path.join(_checkpoint("mcore_ref_adapter", grpo.mcore_ref_adapter), "adapter")
        if not os.path.isdir(adapter):
            raise UserError(f"--mcore_ref_adapter {grpo.mcore_ref_adapter}: no adapter/ "
                            f"directory (is it a checkpoint of a --train_type lora run?)")
        return adapter
    return None


def reference_source(grpo, lora: bool, policy_model_dir: str, policy_weights_dir: Optional[str],
                     resolve_hf: Callable[[str], str]) -> Optional[ReferenceSource]:
    """The frozen reference to load, or None when there is none (beta 0) or when it is the LoRA
    policy with its adapters disabled. resolve_hf turns --ref_model into a local directory."""
    custom = grpo.ref_model or grpo.mcore_ref_model or grpo.ref_adapters or grpo.mcore_ref_adapter
    if grpo.beta == 0 or (lora and not custom):
        return None
    if grpo.mcore_ref_model:
        weights = _checkpoint("mcore_ref_model", grpo.mcore_ref_model)
        return ReferenceSource(hf_dir(weights), weights, _adapter_dir(grpo))
    if grpo.ref_model:
        return ReferenceSource(resolve_hf(grpo.ref_model), None, _adapter_dir(grpo))
    return ReferenceSource(policy_model_dir, policy_weights_dir, _adapter_dir(grpo))


class Reference:
    """Forward-only logprobs of the reference: `frozen` model chunks, or (None) the LoRA policy
    with adapters disabled."""

    def __init__(self, frozen: Optional[List[torch.nn.Module]], policy_chunks: List[torch.nn.Module]):
        self.frozen, self.policy_chunks = frozen, policy_chunks

    def logprobs(self, micro: List[dict], collect) -> List[dict]:
        """The collect callback's outputs per micro-batch (on the last stage)."""
        if self.frozen is not None:
            return forward_backward(self.frozen, micro, collect, True)
        with disabled(unwrap(self.policy_chunks[0])):
            return forward_backward(self.policy_chunks, micro, collect, True)

    @torch.no_grad()
    def mix_in_policy(self, alpha: float) -> None:
        """--sync_ref_model: ref = alpha * policy + (1 - alpha) * ref, parameter by parameter
        (this rank's shards; both models have the policy's architecture and layout)."""
        ref = dict(unwrap(self.frozen[0]).named_parameters())
        policy = dict(unwrap(self.policy_chunks[0]).named_parameters())
        if ref.keys() != policy.keys():
            raise UserError("--sync_ref_model needs a reference of the policy's architecture "
                            "(drop --ref_model / --mcore_ref_model / the reference adapter)")
        for name, param in ref.items():
            param.mul_(1 - alpha).add_(policy[name].to(param.dtype), alpha=alpha)

    def save(self, directory: str) -> None:
        """The mixed reference weights under directory/ref_model (collective)."""
        save_model(self.frozen, os.path.join(directory, REF_DIR), exist_ok=True)

    def load(self, directory: str) -> bool:
        """Restore saved reference weights from a checkpoint; False when it has none."""
        path = os.path.join(directory, REF_DIR)
        if not os.path.isdir(path):
            return False
        load_model(self.frozen, path)
        return True
