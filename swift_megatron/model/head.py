"""What the loss callbacks of training/step.py get from the last pipeline stage: the final hidden
states and the model whose output layer follows them (`FinalHidden`), not the logits. GRPO's
callbacks turn them into logprobs chunk by chunk (model/logprobs.py `head_logprobs`), so no
[tokens, vocab] logits or logit gradient is ever held: at a vocabulary of 152k that is 2 x 2.3 GiB
per 8k-token micro-batch in bf16. A callback that wants the logits (export's logits check) asks
for them (`FinalHidden.logits`, megatron's own output layer).

megatron's GPTModel skips its output layer when `post_process` is off; `hidden_states_out`
switches it off around the forward (the decoder keeps its final norm).
"""
import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import mappings

from swift_megatron.model.logprobs import head_logprobs


@contextlib.contextmanager
def hidden_states_out(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block `model` (a GPTModel) returns its final hidden states [s, b, h] (with
    sequence parallelism this rank's [s / TP, b, h]) instead of logits."""
    if not model.post_process:
        yield
        return
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True


@dataclasses.dataclass(frozen=True)
class FinalHidden:
    """The last stage's final hidden states and its GPTModel."""

    hidden: torch.Tensor      # [s, b, h]; [s / TP, b, h] with sequence parallelism
    model: torch.nn.Module    # the GPTModel (post_process: it holds the output layer)

    def _tied_weight(self) -> Optional[torch.Tensor]:
        """The embedding's weight when the output layer shares it (as GPTModel passes it)."""
        if self.model.share_embeddings_and_output_weights:
            return self.model.shared_embedding_or_output_weight()
        return None

    def _tokens(self) -> torch.Tensor:
        """[s x b, h] in the hidden states' own [s, b] order (a view: their gradient comes back
        row-major, which megatron's frozen linears need under LoRA to run one product instead of
        one per position), the same on every TP rank, its gradient summed over TP in the
        backward (as megatron's output layer does: the sequence-parallel all-gather, or a copy
        whose backward all-reduces)."""
        hidden = self.hidden
        if self.model.config.sequence_parallel:
            hidden = mappings.gather_from_sequence_parallel_region(hidden, True)
        tokens = hidden.reshape(-1, hidden.shape[-1])
        if not self.model.config.sequence_parallel and mpu.get_tensor_model_parallel_world_size() > 1:
            tokens = mappings.copy_to_tensor_model_parallel_region(tokens)
        return tokens

    def logprobs(self, targets: torch.Tensor, temperature: float, vocab_size: int,
                 with_entropy: bool = False):
        """log p(targets) in float32, shaped like `targets` ([b, s], or a packed micro-batch's
        [T]); with `with_entropy` also the entropy per position (no gradient)."""
        weight = self._tied_weight()
        weight = self.model.output_layer.weight if weight is None else weight
        order = targets.t() if targets.dim() == 2 else targets     # [s, b], as the hidden states
        values = head_logprobs(self._tokens(), weight, order.reshape(-1), temperature,
                               vocab_size, with_entropy=with_entropy)
        values = values if with_entropy else (values,)
        values = tuple(v.view(order.shape).t().contiguous() if targets.dim() == 2 else v
                       for v in values)
        return values if with_entropy else values[0]

    def logits(self) -> torch.Tensor:
        """[b, s, V / TP]: megatron's output layer, what GPTModel's forward would have returned."""
        logits, _ = self.model.output_layer(self.hidden, weight=self._tied_weight())
        return logits.transpose(0, 1).contiguous()
