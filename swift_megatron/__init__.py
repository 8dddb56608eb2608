"""swift-megatron: GRPO post-training of Hugging Face causal LMs on a Megatron-core backend.

Importing this package is cheap (no torch): the command-line layer parses and validates flags
before any heavy import. See docs/ for the commands and DESIGN notes in the repository.
"""
__version__ = "0.1.0"

import warnings as _warnings

# megatron-core warns at import that optional fused kernels (Apex, Transformer Engine) are absent;
# we do not use them, so the notice is noise for our users.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
    _warnings.filterwarnings("ignore", message=_message)
