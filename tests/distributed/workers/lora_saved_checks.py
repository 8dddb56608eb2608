"""Worker (one process): LoRA's modules trained in full (modules_to_save, lora/saved.py) and
target_regex on tiny llama (untied embeddings) and qwen3 (tied), against peft; writes
{out_dir}/rank0.json: {family: {check: result}} for tests/unit/test_lora_saved.py.

    python -m torch.distributed.run --nproc_per_node 1 \\
        tests/distributed/workers/lora_saved_checks.py --out_dir OUT --root MODELS

Checks (float32; adapters with random nonzero B, the trained modules moved by seeded noise as
training would):
    saved       what trains, the base model with adapters disabled, the PEFT files (keys and
                adapter_config.json), peft's logits on our adapter, our merged export and
                merge_adapter_into_hf against peft's merge_and_unload, and load_adapter back
    checkpoint  a distributed checkpoint of the LoRA model: a LoRA model loads it whole (trained
                weights and base copies), a model without adapters loads its base
    peft_made   an adapter peft creates with modules_to_save (tied: ensure_weight_tying) loads
                with peft's logits
    regex       (qwen3) target_regex in HF names and in Megatron names: the adapted modules,
                adapter_config.json's target_modules, peft's logits, load_adapter back
"""
import argparse
import json
import os

from lora_checks import ALPHA, R, SEED, hf_logits, hf_model, mcore
from lora_common import max_abs, seeded_normal

# ms-swift's Megatron names for llama, the HF ones for qwen3
SAVED = {"llama": ("word_embeddings", "output_layer"), "qwen3": ("embed_tokens",)}


def train_saved(model):
    """Move the weights that train in full by seeded noise (what an optimizer would do)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and not getattr(param, "bridge_skip", False):
                param.add_(seeded_normal(param.shape, SEED, name, 0.05))


def _trainable(model):
    return sorted(n for n, p in model.named_parameters()
                  if p.requires_grad and not getattr(p, "bridge_skip", False))


def check_saved(family, hf_dir, state, tokens, work):
    from safetensors.torch import load_file

    from swift_megatron.export import mcore_logits, merge_adapter_into_hf
    from swift_megatron.lora import LoraConfig, disabled, load_adapter, save_adapter

    lora = LoraConfig(r=R, lora_alpha=ALPHA, seed=SEED, modules_to_save=SAVED[family])
    loaded, base = mcore(hf_dir, state, lora), mcore(hf_dir, state)
    base_logits = mcore_logits(base, tokens, state)
    train_saved(loaded.model)
    ours = mcore_logits(loaded, tokens, state)
    with disabled(loaded.model):
        off = mcore_logits(loaded, tokens, state)
        base_export = dict(loaded.bridge.export(loaded.model))
    adapter = os.path.join(work, "adapter")
    save_adapter(loaded.model, adapter, hf_dir, lora, loaded.bridge)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    fresh = mcore(hf_dir, state)
    load_adapter(fresh.model, adapter, fresh.bridge)
    with disabled(fresh.model):
        fresh_off = mcore_logits(fresh, tokens, state)
    merged = os.path.join(work, "merged")
    merge_adapter_into_hf(hf_dir, adapter, merged, state)
    peft_model = hf_model(hf_dir, adapter)
    theirs = hf_logits(peft_model, tokens)
    peft_merged = peft_model.merge_and_unload().state_dict()
    exported, plain = dict(loaded.bridge.export(loaded.model)), dict(base.bridge.export(base.model))
    return {"trainable": _trainable(loaded.model),
            "disabled_is_base": bool((off == base_logits).all()),
            "base_export_is_base": all(bool((t == plain[n]).all()) for n, t in base_export.items()),
            "saved_moves_logits": max_abs(ours, base_logits),
            "keys": sorted(k for k in load_file(os.path.join(adapter, "adapter_model.safetensors"))
                           if ".lora_" not in k),
            "config": {k: config.get(k) for k in ("modules_to_save", "ensure_weight_tying")},
            "peft_logits": max_abs(ours, theirs),
            "merge_vs_peft": max(max_abs(t, peft_merged[n]) for n, t in exported.items()),
            "merged_hf_vs_peft": max_abs(hf_logits(hf_model(merged), tokens), theirs),
            "round_trip": max_abs(mcore_logits(fresh, tokens, state), ours),
            "round_trip_disabled_is_base": bool((fresh_off == base_logits).all())}


def check_checkpoint(family, hf_dir, state, tokens, work):
    from swift_megatron.checkpoint.dist import load_model, save_model
    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import LoraConfig, disabled

    lora = LoraConfig(r=R, lora_alpha=ALPHA, seed=SEED, modules_to_save=SAVED[family])
    loaded = mcore(hf_dir, state, lora)
    train_saved(loaded.model)
    directory = os.path.join(work, "checkpoint")
    save_model([loaded.model], directory)
    resumed = mcore(hf_dir, state, lora, b_seed=None)
    load_model([resumed.model], directory)
    plain = mcore(hf_dir, state)
    base_logits = mcore_logits(plain, tokens, state)
    load_model([plain.model], directory)
    with disabled(resumed.model):
        off = mcore_logits(resumed, tokens, state)
    return {"resumed": max_abs(mcore_logits(resumed, tokens, state),
                               mcore_logits(loaded, tokens, state)),
            "resumed_disabled_is_base": bool((off == base_logits).all()),
            "plain_loads_base": bool((mcore_logits(plain, tokens, state) == base_logits).all())}


def check_peft_made(family, hf_dir, state, tokens, work):
    """An adapter peft creates with modules_to_save (its B and modules moved by seeded noise;
    tied: with ensure_weight_tying) loads into ours with peft's logits."""
    import peft
    import torch

    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import load_adapter

    tied = family == "qwen3"
    model = peft.get_peft_model(hf_model(hf_dir), peft.LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
        modules_to_save=["embed_tokens"] if tied else ["embed_tokens", "lm_head"],
        ensure_weight_tying=tied))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(seeded_normal(param.shape, SEED, name, 0.05))
    adapter = os.path.join(work, "peft_made")
    model.save_pretrained(adapter)
    loaded = mcore(hf_dir, state)
    load_adapter(loaded.model, adapter, loaded.bridge)
    ours = mcore_logits(loaded, tokens, state)
    return {"max_abs_diff": max_abs(ours, hf_logits(model.eval(), tokens)),
            "effect": max_abs(ours, hf_logits(hf_model(hf_dir), tokens))}


REGEXES = {"hf": r".*layers\.[01]\.self_attn\.(q|v)_proj",
           "megatron": r"decoder\.layers\.2\.(self_attention\.linear_qkv|mlp\.linear_fc2)"}


def check_regex(hf_dir, state, tokens, work, regex):
    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import LoraConfig, adapter_state_dict, load_adapter, save_adapter

    lora = LoraConfig(r=R, lora_alpha=ALPHA, seed=SEED, target_regex=regex)
    loaded = mcore(hf_dir, state, lora)
    adapter = os.path.join(work, "adapter")
    save_adapter(loaded.model, adapter, hf_dir, lora, loaded.bridge)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        targets = json.load(f)["target_modules"]
    ours = mcore_logits(loaded, tokens, state)
    fresh = mcore(hf_dir, state)
    load_adapter(fresh.model, adapter, fresh.bridge)
    return {"adapted": sorted({k[len("base_model.model."):].rsplit(".lora_", 1)[0]
                               for k in adapter_state_dict(loaded.model)}),
            "target_modules": targets,
            "peft_logits": max_abs(ours, hf_logits(hf_model(hf_dir, adapter), tokens)),
            "lora_effect": max_abs(ours, mcore_logits(mcore(hf_dir, state), tokens, state)),
            "round_trip": max_abs(mcore_logits(fresh, tokens, state), ours)}


def run_family(family, root, out, state):
    from swift_megatron.export import random_tokens
    from swift_megatron.fixtures import build_tiny_model

    hf_dir = os.path.join(root, family)
    if not os.path.isdir(hf_dir):
        build_tiny_model(family, hf_dir)
    work = os.path.join(out, family)
    tokens = random_tokens(500, 64, "cpu")
    result = {"saved": check_saved(family, hf_dir, state, tokens, os.path.join(work, "saved")),
              "checkpoint": check_checkpoint(family, hf_dir, state, tokens,
                                             os.path.join(work, "ckpt")),
              "peft_made": check_peft_made(family, hf_dir, state, tokens, work)}
    if family == "qwen3":
        result["regex"] = {name: check_regex(hf_dir, state, tokens, os.path.join(work, name), rx)
                           for name, rx in REGEXES.items()}
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--root")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    from swift_megatron.parallel.state import ParallelState

    hf_logging.set_verbosity_error()
    state = ParallelState.initialize(device="cpu", seed=0)
    results = {family: run_family(family, args.root, args.out_dir, state) for family in SAVED}
    with open(os.path.join(args.out_dir, "rank0.json"), "w") as f:
        json.dump(results, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
