"""On-policy distillation as RL (OPD-RL, --teacher_model): a frozen teacher scores the tokens
the policy sampled, and its logprobs join the advantages per token,

    A_t = A + teacher_kl_coef * (teacher logprob of token t - old policy logprob of token t),

the negative k1 estimate of KL(student || teacher) (losses.token_advantages). The teacher is
loaded like the policy, on the trainer's ranks with the trainer's TP/PP layout, and runs one
pipelined forward-only pass per rollout batch over the same micro-batches (packed or padded):
its logprobs come back as [B, S] on the last stage. It may be another size of a supported
family; it must share the policy's tokenizer (checked at load). --offload_teacher_model keeps
its weights in host memory except during that pass.
"""
import dataclasses
import os
from functools import partial
from typing import List

import torch

from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo.objective import LossSettings, collect_logprobs
from swift_megatron.training.offload import model_offloader, resident
from swift_megatron.training.step import forward_backward


def check_same_tokenizer(teacher_dir: str, tokenizer, flag: str = "--teacher_model") -> None:
    """UserError when the directory's tokenizer maps tokens to other ids than the policy's
    (a directory without tokenizer files is taken to share the policy's)."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(teacher_dir, name)) for name in names):
        return
    theirs = AutoTokenizer.from_pretrained(teacher_dir)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"{flag} {teacher_dir}: its tokenizer differs from the policy's; the "
                        f"teacher must score the policy's token ids (use a model of the same "
                        f"family and tokenizer)")


class Teacher:
    """The frozen teacher chunks of this stage and their real vocabulary size."""

    def __init__(self, chunks: List[torch.nn.Module], vocab_size: int, offload: bool):
        self.chunks, self.vocab_size = chunks, vocab_size
        self.offloader = model_offloader(chunks) if offload else None
        if self.offloader:
            self.offloader.offload()

    @torch.no_grad()
    def fill_logprobs(self, micro: List[dict], settings: LossSettings) -> None:
        """micro_batch["teacher_logprobs"] [B, S] for every micro-batch (on the last stage)."""
        collect = partial(collect_logprobs, dataclasses.replace(settings, vocab_size=self.vocab_size))
        with resident(self.offloader, read_only=True):
            outputs = forward_backward(self.chunks, micro, collect, True)
        for micro_batch, out in zip(micro, outputs):
            micro_batch["teacher_logprobs"] = out["logprobs"]

