"""Work-arounds for megatron-core 0.16.1: running without Transformer Engine (our only setup: TE
is absent on CPU and on the GPU machine), and its `layernorm` selective recomputation.

- TransformerConfig's warning about Transformer Engine's fused attention, printed on every run
  with ms-swift's default --recompute_modules core_attn, is silenced: it concerns TE runs only.
- moe_utils references `te_general_gemm` in the router's linear function but defines it only
  when TE imports; without TE the router crashes with NameError. Defining it as None selects
  megatron's own torch.mm path.
- CheckpointWithoutOutput (--recompute_modules layernorm) takes itself for an FP8 run whenever
  its `fp8` argument is not None (TransformerLayer passes none, so the default False) and then
  asks Transformer Engine's FP8 state: NameError without TE. Without TE there is no FP8, so
  its `fp8` is set False after construction: megatron's plain path.
- CheckpointWithoutOutput saves the norm's input in an autograd Function and discards the
  norm's output. When that input needs no gradient (the first layer over a frozen embedding:
  LoRA, --freeze_llm) the Function is not part of the graph, nothing is saved, and the
  recomputation, triggered by the attention output's gradient (which LoRA adapters do need),
  calls the norm with no input: TypeError in the backward. There the norm runs as usual and its
  output is kept (what it would cost without recomputation, for that layer only).
"""
import warnings

import torch
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import moe_utils

_PATCHED = "swift_megatron_patched"


def _patched(function):
    setattr(function, _PATCHED, True)
    return function


def _init_without_fp8(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False
    return _patched(__init__)


def _checkpoint_needing_grad(checkpoint):
    def checkpoint_or_run(self, run_function, *args):
        self.plain = not (torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args))
        return run_function(*args) if self.plain else checkpoint(self, run_function, *args)
    return _patched(checkpoint_or_run)


def _discard_unless_plain(discard):
    def discard_output_and_register_recompute(self, hook_tensor):
        if not getattr(self, "plain", False):
            discard(self, hook_tensor)
    return _patched(discard_output_and_register_recompute)


# TransformerConfig warns about Transformer Engine's fused attention whenever "core_attn" is among
# --recompute_modules (ms-swift's default): advice for TE runs, which ours never are
TE_ADVICE = "If you are using transformer_engine as the transformer implementation"


def apply() -> None:
    warnings.filterwarnings("ignore", message=TE_ADVICE, category=UserWarning)
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    cls = mcore_random.CheckpointWithoutOutput
    if getattr(cls.checkpoint, _PATCHED, False):
        return
    if not mcore_random.HAVE_TE:
        cls.__init__ = _init_without_fp8(cls.__init__)
    cls.checkpoint = _checkpoint_needing_grad(cls.checkpoint)
    cls.discard_output_and_register_recompute = _discard_unless_plain(
        cls.discard_output_and_register_recompute)


apply()
