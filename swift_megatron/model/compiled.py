"""Groups of pure tensor functions that run compiled by torch.compile where that pays, eagerly
elsewhere. On CUDA, Inductor fuses each function into one kernel (with autograd, one forward and
one backward kernel) where eager PyTorch launches a kernel, and makes a trip through memory, per
op. Off CUDA they run eagerly unless the group's environment variable says 1 (or the tests'
platform/cuda_paths.py `on_cpu()` gives the CPU CUDA's paths: Inductor's C++ backend); 0 keeps
them eager everywhere (a GPU whose Triton / Inductor cannot build the kernels). A compile that fails
in a forward warns once and the group computes eagerly from then on: the same math.

Numerics: Inductor computes a chain of bfloat16 elementwise ops in float32 and rounds once, where
eager PyTorch rounds after each op (as vLLM's fused kernels also compute in float32), so a
compiled group's bfloat16 results may differ from the eager ones in the last bit.

The groups: the logprob chunk math (model/logprobs.py, SWIFT_MEGATRON_COMPILE_LOGPROBS) and each
decoder layer's elementwise math, RMSNorm, SwiGLU and packed RoPE (model/activations.py,
model/rope.py, SWIFT_MEGATRON_COMPILE_LAYERS).
"""
import logging
import os
from typing import Callable, Dict, Optional, Union

import torch

from swift_megatron.platform.cuda_paths import takes_cuda_paths

logger = logging.getLogger(__name__)

LAYERS_ENV = "SWIFT_MEGATRON_COMPILE_LAYERS"
# compiled variants torch keeps per function before it stops compiling (torch's default 8): a
# layer's norm meets about a dozen (hidden and head widths, its checkpoint's forward without
# grad and recomputation with, evaluation, views of other layouts), all made in the first
# micro-batches; past the limit a fullgraph compile fails and the group would turn eager
RECOMPILE_LIMIT = 64


class Compiled:
    """Named pure functions, compiled together at first use where `mode` says so: "auto" (where
    the CUDA paths are taken: platform/cuda_paths.py), True or False; the environment variable `env` set to 0 or 1 overrides "auto".
    `token_major[name]`: how many leading tensor arguments of that function have the token
    count as their first dimension, compiled for any count from the first call (no recompile
    per micro-batch size)."""

    def __init__(self, what: str, env: str, token_major: Optional[Dict[str, int]] = None,
                 **functions: Callable):
        self.what, self.env, self.eager = what, env, functions
        self.token_major = token_major or {}
        self.mode: Union[str, bool] = {"0": False, "1": True}.get(os.environ.get(env, ""), "auto")
        self.compiled: Dict[str, Callable] = {}   # empty until first used compiled
        self.failed = False

    def set_mode(self, mode: Union[str, bool]) -> None:
        """Compile "auto" (on CUDA), always (True) or never (False) from the next call on."""
        self.mode, self.compiled, self.failed = mode, {}, False

    @property
    def ran_compiled(self) -> bool:
        """Whether the compiled functions were built and have not failed."""
        return bool(self.compiled) and not self.failed

    def active(self, device: torch.device) -> bool:
        """Whether calls on `device` run the compiled functions."""
        wanted = takes_cuda_paths(device) if self.mode == "auto" else bool(self.mode)
        return wanted and not self.failed

    def run(self, name: str, device: torch.device, *args):
        """functions[name](*args), compiled when active on `device`. Inside a region that
        something else compiles (megatron-core's `jit_fuser`, torch.compile around
        `GatedDeltaNet._apply_gated_norm`; a user's torch.compile) the eager function runs:
        that compile traces it and fuses it with its neighbours, and dynamo forbids calling its
        own API (`maybe_mark_dynamic`) from code it traces."""
        if not self.active(device) or torch.compiler.is_compiling():
            return self.eager[name](*args)
        if not self.compiled:
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
            self.compiled = {key: torch.compile(fn, fullgraph=True)
                             for key, fn in self.eager.items()}
        for arg in args[:self.token_major.get(name, 0)]:
            torch._dynamo.maybe_mark_dynamic(arg, 0)
        try:
            return self.compiled[name](*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # an Inductor / Triton failure: the eager math is the same
            logger.warning("torch.compile of the %s failed (%s); computing them eagerly from "
                           "now on (%s=0 skips the compile)", self.what, error, self.env)
            self.failed = True
            return self.eager[name](*args)
