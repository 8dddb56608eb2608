"""The embedded rollout engine: sampling with transformers' `generate`, in the training process.

It lets the GRPO loop run anywhere (CPU CI, a GPU without vLLM). The HF model is built from
the checkpoint's config only; its weights always arrive through `update_weights` from the
bridge's export stream, the same path vLLM uses, so what it samples from is the policy.
Logprobs are of softmax(logits / temperature), as vLLM reports them.

Sampling is Gumbel-max with one random stream per request: each request's sample depends only
on its seed, never on the batch it shares or the process that generates it, so rollouts are
reproducible across parallel layouts.

A vision-language model (Qwen2.5-VL, Qwen3.5 with its vision tower) takes images:
`generate(..., images=[...])` gives each request None or its prompt's `pixel_values` /
`image_grid_thw` (data/images.py `ImageEncoder.encode`), and transformers computes the 3-D
positions itself.

With `routed_experts` (--router_replay_mode R3) each completion carries the experts its MoE
routers chose while generating it (forward hooks on transformers' top-k routers: the prompt's
rows of the prefill, then one row per decoding step), as vLLM returns them.
"""
import re
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from swift_megatron.model.vision import has_vision
from swift_megatron.rollout.engine import Completion, SamplingConfig, default_seeds

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# checkpoint prefix of a multimodal model's text stack (Qwen3.5), "model." in a causal LM
_TEXT_STACK = "model.language_model."


class _GumbelMax:
    """Logits processor: add Gumbel noise from one generator per row, so that the greedy pick
    (argmax) is a sample from softmax(scores) (the scores are already temperature-scaled and
    top-k/top-p filtered by the processors before it)."""

    def __init__(self, seeds: Sequence[int], device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(int(s) % 2**63) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device)
                               for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
        return scores.float() + gumbel


def _processors(sampling: SamplingConfig, seeds: Sequence[int], device: torch.device):
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    chain = []
    if sampling.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    chain.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        chain.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        chain.append(TopPLogitsWarper(sampling.top_p))
    chain.append(_GumbelMax(seeds, device))
    return LogitsProcessorList(chain)


class _RouteRecorder:
    """The experts each MoE router of a transformers model chose during one `generate` call of
    a left-padded batch (forward hooks on the routers; their outputs are (logits, weights,
    indices), the indices [rows, top_k] of the batch's rows flattened per position)."""

    def __init__(self, model: torch.nn.Module):
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        if not routers:
            raise ValueError("routed experts asked of a model without MoE routers")
        self.calls: List[List[torch.Tensor]] = [[] for _ in routers]
        self.handles = [router.register_forward_hook(self._hook(layer))
                        for layer, router in enumerate(routers)]

    def _hook(self, layer: int):
        def record(module, args, output):
            self.calls[layer].append(output[2].to(torch.int16).cpu())
        return record

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def rows(self, width: int, prompt_lengths: Sequence[int],
             completion_lengths: Sequence[int]) -> list:
        """Per row: [prompt + completion - 1, layers, top_k] int16 numpy (the prefill's rows of
        its prompt, then its decoding steps but the last token's, which never ran)."""
        batch = len(prompt_lengths)
        layers = []
        for calls in self.calls:
            steps = [c.view(batch, 1, -1) for c in calls[1:]]
            layers.append((calls[0].view(batch, width, -1),
                           torch.cat(steps, dim=1) if steps else calls[0].new_zeros(batch, 0, 1)))
        return [torch.stack([torch.cat([prefill[r, width - p:], decoded[r, :c - 1]])
                             for prefill, decoded in layers], dim=1).numpy()
                for r, (p, c) in enumerate(zip(prompt_lengths, completion_lengths))]


class HFEngine:
    """A transformers causal LM that generates for this process's share of the requests."""

    def __init__(self, hf_dir: str, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: Sequence[int], pad_token_id: int, max_batch_size: int = 64,
                 routed_experts: bool = False, attn_implementation: Optional[str] = None):
        """`attn_implementation`: transformers' (--attn_impl), None for its default."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(hf_dir)
        # vision-language models (Qwen2.5-VL, Qwen3.5 with its tower): the whole model
        auto = AutoModelForImageTextToText if has_vision(config.to_dict()) \
            else AutoModelForCausalLM
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self.model = auto.from_config(config, dtype=dtype, **extra).to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.eos = list(eos_token_ids)
        self.pad = pad_token_id
        self.max_batch_size = max_batch_size
        self.routed_experts = routed_experts
        self.weight_version = 0
        self.weights_discarded = False
        self.sync_position = "loading the weights into the embedded transformers engine"
        self.image_token_id = getattr(config, "image_token_id", None)
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seeds: Optional[Sequence[int]] = None,
                 images: Optional[Sequence[Optional[Mapping]]] = None) -> List[Completion]:
        if seeds is None:
            seeds = default_seeds(sampling, len(prompts))
        images = [None] * len(prompts) if images is None else list(images)
        completions: List[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            stop = start + self.max_batch_size
            completions += self._generate_batch(prompts[start:stop], sampling, seeds[start:stop],
                                                images[start:stop])
        return completions

    def _image_kwargs(self, ids: torch.Tensor, images: Sequence[Optional[Mapping]]) -> dict:
        """generate()'s image inputs of a batch: pixels and grids in row order, and the image
        token mask transformers computes the 3-D positions from."""
        rows = [i for i in images if i is not None]
        if not rows:
            return {}
        return dict(pixel_values=torch.cat([r["pixel_values"] for r in rows]).to(self.device),
                    image_grid_thw=torch.cat([r["image_grid_thw"] for r in rows]).to(self.device),
                    mm_token_type_ids=(ids == self.image_token_id).int())

    def _generate_batch(self, prompts, sampling: SamplingConfig, seeds,
                        images: Sequence[Optional[Mapping]]) -> List[Completion]:
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        config = GenerationConfig(do_sample=False, max_new_tokens=sampling.max_tokens,
                                  eos_token_id=self.eos, pad_token_id=self.pad,
                                  return_dict_in_generate=True, output_logits=True)
        ids = ids.to(self.device)
        recorder = _RouteRecorder(self.model) if self.routed_experts else None
        try:
            out = self.model.generate(input_ids=ids, attention_mask=mask.to(self.device),
                                      generation_config=config,
                                      logits_processor=_processors(sampling, seeds, self.device),
                                      **self._image_kwargs(ids, images))
        finally:
            if recorder is not None:
                recorder.close()
        new_tokens = out.sequences[:, width:].cpu()
        steps = torch.stack(out.logits, dim=1).float() / sampling.temperature  # [B, T, V]
        logprobs = torch.log_softmax(steps, dim=-1).gather(
            -1, new_tokens.to(steps.device).unsqueeze(-1)).squeeze(-1).cpu()
        completions = [self._completion(new_tokens[row], logprobs[row])
                       for row in range(len(prompts))]
        if recorder is not None:
            routes = recorder.rows(width, [len(p) for p in prompts],
                                   [len(c.token_ids) for c in completions])
            for completion, route in zip(completions, routes):
                completion.routed_experts = route
        return completions

    def _completion(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> Completion:
        tokens = tokens.tolist()
        stop = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        length = len(tokens) if stop is None else stop + 1
        reason = "stop" if stop is not None else "length"
        return Completion(tokens[:length], logprobs[:length].tolist(), reason, self.weight_version)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self._target(name).copy_(tensor.to(self.device))
        self.weight_version += 1

    def _target(self, name: str) -> torch.Tensor:
        """The parameter (or slice of a fused expert tensor, transformers 5.x) for an HF name
        (a multimodal checkpoint's text-stack names map to the causal LM's)."""
        if name.startswith(_TEXT_STACK):
            name = "model." + name[len(_TEXT_STACK):]
        if name in self._params:
            return self._params[name]
        # hub names of a vision-language model held whole (model.layers.*, visual.*)
        for alias in (_TEXT_STACK + name[len("model."):], "model." + name):
            if alias in self._params:
                return self._params[alias]
        found = _EXPERT.match(name)
        if found is None:
            raise KeyError(f"the embedded engine's model has no parameter {name}")
        prefix, expert, kind = found.group(1), int(found.group(2)), found.group(3)
        if f"{prefix}.down_proj" not in self._params:   # a multimodal model held whole
            prefix = _TEXT_STACK + prefix[len("model."):]
        if kind == "down":
            return self._params[f"{prefix}.down_proj"][expert]
        fused = self._params[f"{prefix}.gate_up_proj"][expert]
        half = fused.shape[0] // 2
        return fused[:half] if kind == "gate" else fused[half:]

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None

    def abandon(self) -> None:
        return None   # it holds nothing outside this process

    def close(self) -> None:
        self.model = None
        self._params = {}
