"""The reference model of GRPO's KL term (needed when --beta > 0), as ms-swift's flags choose it:

- full training: a frozen copy of the starting weights (--model / --mcore_model);
- LoRA: the policy itself with its adapters disabled (no second model in memory);
- another reference: --ref_model (an HF directory or hub id) or --mcore_ref_model (a Megatron
  checkpoint, ours or ms-swift's), and/or an adapter on it, --ref_adapters / --mcore_ref_adapter
  (PEFT, or a LoRA checkpoint, ours or ms-swift's): a frozen model of its own, whatever
  --train_type. It may be another
  size of a supported family as long as it shares the policy's tokenizer.

--sync_ref_model (TR-DPO) moves the frozen reference towards the policy every
--ref_model_sync_steps optimizer steps, ref = alpha * policy + (1 - alpha) * ref; those weights
are part of the training state: each checkpoint saves them under ref_model/ and resume loads them.
--offload_ref_model keeps a frozen reference in host memory except while it is used (its
logprob pass, a sync, a save or a load). The reference never replays routes (--router_replay_mode):
its MoE routers route themselves, as ms-swift's.
"""
import os
from typing import ContextManager, List, Optional

import torch

from swift_megatron.checkpoint.dist import load_model, save_model
from swift_megatron.errors import UserError
from swift_megatron.lora import disabled
from swift_megatron.model.routing_replay import without_routes
from swift_megatron.model.wrappers import unwrap
from swift_megatron.training.offload import model_offloader, resident
from swift_megatron.training.step import forward_backward

REF_DIR = "ref_model"  # inside a checkpoint directory, with --sync_ref_model


class Reference:
    """Forward-only logprobs of the reference: `frozen` model chunks, or (None) the LoRA policy
    with adapters disabled. `offload`: the frozen chunks live in host memory outside `resident()`."""

    def __init__(self, frozen: Optional[List[torch.nn.Module]], policy_chunks: List[torch.nn.Module],
                 offload: bool = False):
        self.frozen, self.policy_chunks = frozen, policy_chunks
        self.offloader = model_offloader(frozen) if offload and frozen is not None else None
        if self.offloader:
            self.offloader.offload()

    def resident(self, read_only: bool = False) -> ContextManager:
        """The frozen weights on their device inside the block (a no-op unless offloaded);
        `read_only`: the block does not change them (nothing to copy back after it)."""
        return resident(self.offloader, read_only)

    def logprobs(self, micro: List[dict], collect) -> List[dict]:
        """The collect callback's outputs per micro-batch (on the last stage)."""
        if self.frozen is not None:
            with self.resident(read_only=True):
                return forward_backward(self.frozen, micro, collect, True)
        with disabled(unwrap(self.policy_chunks[0])):   # the reference routes itself
            return forward_backward(self.policy_chunks, [without_routes(mb) for mb in micro],
                                    collect, True)

    @torch.no_grad()
    def mix_in_policy(self, alpha: float) -> None:
        """--sync_ref_model: ref = alpha * policy + (1 - alpha) * ref, parameter by parameter
        (this rank's shards; both models have the policy's architecture and layout)."""
        ref = {(i, n): p for i, c in enumerate(self.frozen) for n, p in unwrap(c).named_parameters()}
        policy = {(i, n): p for i, c in enumerate(self.policy_chunks)
                  for n, p in unwrap(c).named_parameters()}
        if ref.keys() != policy.keys():
            raise UserError("--sync_ref_model needs a reference of the policy's architecture "
                            "(drop --ref_model / --mcore_ref_model / the reference adapter)")
        with self.resident():
            for name, param in ref.items():
                param.mul_(1 - alpha).add_(policy[name].to(param.dtype), alpha=alpha)

    def save(self, directory: str) -> None:
        """The mixed reference weights under directory/ref_model (collective)."""
        with self.resident(read_only=True):
            save_model(self.frozen, os.path.join(directory, REF_DIR), exist_ok=True)

    def load(self, directory: str) -> bool:
        """Restore saved reference weights from a checkpoint; False when it has none."""
        path = os.path.join(directory, REF_DIR)
        if not os.path.isdir(path):
            return False
        with self.resident():
            load_model(self.frozen, path)
        return True
