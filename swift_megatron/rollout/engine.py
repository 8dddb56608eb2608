"""The RolloutEngine protocol and the data that crosses it.

Every training process calls `generate` with ITS share of the requests and gets completions
for exactly those requests, in order (an engine spanning several processes, e.g. vLLM with
tensor parallelism, gathers and scatters internally). After each optimizer phase the trainer
streams the new weights with `update_weights((hf_name, tensor), ...)`; `weight_version` counts
those updates and travels with each completion.
"""
import dataclasses
from typing import Any, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters of one generate call (vLLM's names)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    seed: Optional[int] = None


@dataclasses.dataclass
class Completion:
    """One sampled continuation. `logprobs[i]` is log p(token_ids[i]) under the engine's
    softmax(logits / temperature); finish_reason is "stop" (an EOS token, included in
    token_ids) or "length" (max_tokens reached: truncated). `routed_experts` (an engine asked
    for them, --router_replay_mode R3): the experts the engine's MoE routers chose for every
    token it ran, prompt then completion but the last completion token ([prompt + completion
    - 1 (or prompt + completion), layers, top_k] int16 numpy), else None."""

    token_ids: List[int]
    logprobs: Optional[List[float]]
    finish_reason: str
    weight_version: int = 0
    routed_experts: Optional[Any] = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def encode_routes(routes) -> dict:
    """A completion's routed experts (int16 numpy [tokens, layers, top_k]) as JSON: the shape
    and the little-endian int16 bytes in base64 (what /generate answers)."""
    import base64

    import numpy

    array = numpy.ascontiguousarray(routes, dtype="<i2")
    return {"shape": list(array.shape), "data": base64.b64encode(array.tobytes()).decode()}


def decode_routes(encoded: dict):
    """encode_routes' inverse: an int16 numpy array."""
    import base64

    import numpy

    data = numpy.frombuffer(base64.b64decode(encoded["data"]), dtype="<i2")
    return data.reshape(encoded["shape"]).astype(numpy.int16)


def default_seeds(sampling: SamplingConfig, count: int) -> List[int]:
    """Per-request seeds when the caller gives none: derived from sampling.seed."""
    base = sampling.seed or 0
    return [base * 1_000_003 + i for i in range(count)]


class RolloutEngine(Protocol):
    weight_version: int
    weights_discarded: bool   # True while the engine holds no weights (a sleep of the colocate
                              # engine that discarded them since the last update_weights)
    sync_position: str        # where a running update_weights is (the sync watchdog's message)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seeds: Optional[Sequence[int]] = None,
                 images: Optional[Sequence[Optional[dict]]] = None) -> List[Completion]:
        """One completion per prompt (prompts repeat for several samples of one prompt).
        `seeds`, one per request, make each sample depend on its seed alone (not on how
        requests are batched or split over processes); None derives them from sampling.seed.
        `images`: per request None or the prompt's encoded images (data/images.py
        `ImageEncoder.encode`: PIL images, pixel_values, image_grid_thw) for a
        vision-language model; the prompt's tokens hold its expanded image pads."""

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (the bridge's export stream) and bump weight_version."""

    def sleep(self) -> None:
        """Release memory while the trainer runs (no-op where unsupported)."""

    def wake_up(self) -> None:
        """Reacquire memory before generating."""

    def close(self) -> None:
        """Free every resource."""

    def abandon(self) -> None:
        """On a failing run's way out (an error, Ctrl-C, SIGTERM): give back what the engine
        holds outside this process, with no collective (other ranks may be gone)."""
