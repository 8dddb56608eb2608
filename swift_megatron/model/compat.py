"""Work-arounds for megatron-core 0.16.1 running without Transformer Engine (our only setup:
TE is absent on CPU and on the GPU machine).

- moe_utils references `te_general_gemm` in the router's linear function but defines it only
  when TE imports; without TE the router crashes with NameError. Defining it as None selects
  megatron's own torch.mm path.
- CheckpointWithoutOutput (selective recomputation of `layernorm`) takes itself for an FP8 run
  whenever its `fp8` argument is not None (TransformerLayer passes none, so the default False)
  and then asks Transformer Engine's FP8 state: NameError without TE. Without TE there is no
  FP8, so its `fp8` is set False after construction: megatron's plain path.
"""
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import moe_utils


def _checkpoint_without_fp8(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False
    __init__.swift_megatron_patched = True
    return __init__


def apply() -> None:
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    checkpoint = mcore_random.CheckpointWithoutOutput
    if not mcore_random.HAVE_TE and not getattr(checkpoint.__init__, "swift_megatron_patched",
                                                False):
        checkpoint.__init__ = _checkpoint_without_fp8(checkpoint.__init__)


apply()
