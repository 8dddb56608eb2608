"""Logits of the same tokens from both sides of a conversion: the Megatron model (through
megatron's forward-only schedule, gathered over TP and broadcast from the last pipeline stage)
and the transformers model of an HF directory (with a PEFT adapter applied by peft), plus the
seeded random tokens the precision check runs and `round_weights`, which makes two models'
weights equal to a lower dtype's. torch, megatron and transformers are imported inside the
functions."""
from typing import TYPE_CHECKING, Optional

from swift_megatron.checkpoint.loaded_model import LoadedModel

if TYPE_CHECKING:
    import torch

    from swift_megatron.parallel.state import ParallelState

PRECISION_SEQUENCES = 4   # random sequences the precision check runs
PRECISION_LENGTH = 64     # tokens per sequence (at most max_position_embeddings)
PRECISION_SEED = 0


def random_tokens(vocab_size: int, max_positions: int, device,
                  sequences: int = PRECISION_SEQUENCES, length: int = PRECISION_LENGTH,
                  seed: int = PRECISION_SEED) -> "torch.Tensor":
    """Seeded random token ids [sequences, length] (the same on every rank)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (sequences, min(length, max_positions))
    return torch.randint(0, vocab_size, shape, generator=generator).to(device)


def _gathered_logits(vocab_size: int, micro_batch: dict, output):
    """forward_backward loss callback: full-vocab float32 logits as the micro-batch's metric."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = output.logits()
    full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size].float()
    return logits.new_zeros(()), {"logits": full}


def mcore_logits(loaded: LoadedModel, tokens: "torch.Tensor", state: "ParallelState",
                 extra: Optional[dict] = None) -> "torch.Tensor":
    """float32 logits [b, s, vocab_size] of the Megatron model on every rank: one forward-only
    pass through megatron's (pipelined) schedule, gathered over TP, broadcast from the last
    pipeline stage. `extra`: micro-batch entries besides the tokens and 1-D positions (a
    vision-language model's images and 3-D positions). Collective."""
    import functools

    import torch
    import torch.distributed as dist

    from swift_megatron.training.step import forward_backward

    vocab = loaded.shape.vocab_size
    batch = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1], device=tokens.device)
             .expand_as(tokens).contiguous(), **(extra or {})}
    with torch.no_grad():
        outputs = forward_backward([loaded.model], [batch],
                                   functools.partial(_gathered_logits, vocab), forward_only=True)
    if state.is_last_stage:
        logits = outputs[0]["logits"].contiguous()
    else:
        logits = torch.empty(*tokens.shape, vocab, dtype=torch.float32, device=tokens.device)
    if state.pp > 1:
        dist.broadcast(logits, src=state.last_stage_rank(), group=state.pp_group)
    return logits


def _from_pretrained_dtype_kwarg() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def round_weights(module: "torch.nn.Module", dtype: Optional["torch.dtype"]) -> None:
    """Round every parameter to `dtype` and back, in place: the values a `dtype` checkpoint of
    the same weights holds (no-op for None or a dtype the parameters already have)."""
    import torch

    if dtype is None:
        return
    with torch.no_grad():
        for param in module.parameters():
            if param.dtype != dtype:
                param.copy_(param.to(dtype))


def hf_logits(hf_dir: str, tokens: "torch.Tensor", dtype: "torch.dtype",
              weights_dtype: Optional["torch.dtype"] = None,
              adapter_dir: Optional[str] = None, images: Optional[dict] = None) -> "torch.Tensor":
    """float32 logits [b, s, vocab] of the transformers model of `hf_dir` (with the PEFT adapter
    `adapter_dir` applied by peft, when given), run in `dtype` on the device of `tokens` (its
    weights first rounded to `weights_dtype`, when given). `images`: the image keywords of a
    vision-language model (then its whole image-text-to-text model runs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir, **{_from_pretrained_dtype_kwarg(): dtype})
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir, autocast_adapter_dtype=False)
    model = model.to(tokens.device).eval()
    round_weights(model, weights_dtype)
    with torch.no_grad():
        logits = model(input_ids=tokens, **(images or {})).logits.float()
    del model
    return logits
