"""Work-arounds for megatron-core 0.16.1 running without Transformer Engine (our only setup:
TE is absent on CPU and on the GPU machine).

- moe_utils references `te_general_gemm` in the router's linear function but defines it only
  when TE imports; without TE the router crashes with NameError. Defining it as None selects
  megatron's own torch.mm path.
"""
from megatron.core.transformer.moe import moe_utils


def apply() -> None:
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


apply()
