"""Reward models (--reward_model): sequence-classification models (an HF directory or a hub id)
used as reward functions after --reward_funcs, weighted like them by --reward_weights.

Each training rank loads the model with transformers on its own device and runs it forward-only
on its share of the completions (the rollout collector scores every completion exactly once,
split over the ranks of a model replica). The default scoring is ms-swift's ORM logic: the
prompt's chat messages plus the completion as the assistant turn, formatted with the reward
model's own chat template, and logit 0 of its classification head as the reward.

--reward_model_plugin NAME (one per reward model; `default` is the logic above) instead creates
the class registered as NAME in `rm_plugins` by a file of --external_plugins, as
`cls(model, tokenizer)`, and calls `plugin(inputs=rows, **reward kwargs)` with one row per
completion, {"messages": [...], **dataset columns}; it returns one float (or None) per row.
That is how a generative reward model (an LLM judge calling model.generate) plugs in: as in
ms-swift, a checkpoint whose config names a sequence-classification architecture (or one label)
loads as a classifier, any other as a causal LM.
"""
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from swift_megatron.errors import UserError

BATCH_SIZE = 16  # completions per forward pass


def is_classifier(config) -> bool:
    """Whether an HF config describes a sequence-classification model (ms-swift's test: the
    architecture's name, or a single label)."""
    names = [arch.lower() for arch in getattr(config, "architectures", None) or []]
    return any("sequenceclassification" in arch for arch in names) or config.num_labels == 1


def load_reward_model(name: str, device: torch.device, use_hf: bool = False,
                      plugin: bool = False, attn_implementation: Optional[str] = None):
    """(model, tokenizer) of a reward model, eval mode, on `device` (float32 on the CPU, the
    checkpoint's dtype elsewhere): a sequence classifier, or with a plugin any causal LM. A
    tokenizer without a pad token pads with its eos token (the head reads the last non-pad
    token). `attn_implementation`: transformers' (--attn_impl), None for its default."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoTokenizer)

    from swift_megatron.model.hub import resolve_model_dir

    directory = resolve_model_dir(name, use_hf, None)
    dtype = torch.float32 if device.type == "cpu" else "auto"
    try:
        classifier = is_classifier(AutoConfig.from_pretrained(directory))
        if not (classifier or plugin):
            raise ValueError("its config names no sequence-classification architecture; a "
                             "generative reward model needs a --reward_model_plugin")
        loader = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = loader.from_pretrained(directory, dtype=dtype, **extra)
    except (OSError, ValueError) as error:
        raise UserError(f"--reward_model {name}: not a reward model transformers can load "
                        f"({error})") from None
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval().requires_grad_(False), tokenizer


def chat_text(messages: Sequence[dict], tokenizer) -> str:
    """The conversation as the reward model reads it: its chat template, or without one the
    contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False)
    return "\n".join(str(m.get("content", "")) for m in messages)


class RewardModel:
    """ms-swift's default reward-model logic: logit 0 of the classification head per chat."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def __call__(self, completions: List[str], messages: List[List[dict]], **kwargs) -> List[float]:
        texts = [chat_text(chat, self.tokenizer) for chat in messages]
        scores: List[float] = []
        for start in range(0, len(texts), BATCH_SIZE):
            inputs = self.tokenizer(texts[start:start + BATCH_SIZE], return_tensors="pt",
                                    padding=True).to(self.model.device)
            scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores


class PluginReward:
    """A --reward_model_plugin class behind the reward-function interface."""

    def __init__(self, plugin: Callable):
        self.plugin = plugin

    def __call__(self, completions: List[str], messages: List[List[dict]], **kwargs) -> List[Any]:
        columns = {k: v for k, v in kwargs.items() if isinstance(v, list) and len(v) == len(messages)}
        rows = [dict({k: v[i] for k, v in columns.items()}, messages=chat)
                for i, chat in enumerate(messages)]
        output = self.plugin(inputs=rows, **kwargs)
        if isinstance(output, torch.Tensor):
            output = output.tolist()
        return list(output)


def _plugin_class(name: str):
    # upward: reward-model plugins are registered beside rollout's gym envs and schedulers
    # (one registry module that plugin files and compat/ms_swift fill; torch-free, no cycle)
    from swift_megatron.rollout.plugin_registry import RM_PLUGINS

    return RM_PLUGINS.lookup(name)


def reward_model_funcs(names: Sequence[str], plugins: Sequence[str], device: torch.device,
                       use_hf: bool = False, attn_implementation: Optional[str] = None
                       ) -> List[Tuple[str, Callable]]:
    """[(name, reward function)] for --reward_model / --reward_model_plugin (plugin files must be
    loaded already). The name is the model directory's base name (numbered when repeated)."""
    funcs: List[Tuple[str, Callable]] = []
    for index, name in enumerate(names):
        plugin: Optional[str] = plugins[index] if plugins else "default"
        model, tokenizer = load_reward_model(name, device, use_hf, plugin != "default",
                                             attn_implementation)
        scorer = RewardModel(model, tokenizer) if plugin == "default" else \
            PluginReward(_plugin_class(plugin)(model, tokenizer))
        label = os.path.basename(os.path.normpath(name)) or f"reward_model{index}"
        if any(label == existing for existing, _ in funcs):
            label = f"{label}_{index}"
        funcs.append((label, scorer))
    return funcs
