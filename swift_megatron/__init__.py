"""swift-megatron: GRPO post-training of Hugging Face causal LMs on a Megatron-core backend.

Importing this package is cheap (no torch): the command-line layer parses and validates flags
before any heavy import. See docs/ for the commands and DESIGN notes in the repository.
"""
__version__ = "0.1.0"

import warnings as _warnings

# Known noise from our dependencies, not actionable by users: megatron-core notes at import that
# optional fused kernels (Apex, Transformer Engine) are absent (we do not use them), reads
# `.grad` of non-leaf pipeline outputs, and calls collectives torch has renamed.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "The .grad attribute of a Tensor that is not a leaf Tensor",
                 ".*reduce_scatter_tensor` is deprecated", ".*all_gather_into_tensor` is deprecated"):
    _warnings.filterwarnings("ignore", message=_message)
