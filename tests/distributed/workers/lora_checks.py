"""Worker (one process): LoRA on tiny checkpoints of each family, measured against references
and against peft; writes {out_dir}/rank0.json: {family: {check: result}} for tests/unit/test_lora.py.

    python -m torch.distributed.run --nproc_per_node 1 tests/distributed/workers/lora_checks.py \\
        --out_dir OUT --root MODELS [--families qwen3 qwen2 llama qwen3_moe]

Checks (every model in float32; B random and nonzero unless said otherwise):
    projections     each linear's output vs base + scale * B A x computed from the HF-layout
                    weights (fused q/k/v and gate/up split by hand; hybrid models: a Gated
                    DeltaNet layer's in_proj/out_proj and gated attention), max abs diff
    init            fresh adapters (B = 0) give exactly the base logits; trainable = adapters
    disabled        disabled() gives exactly the base logits
    round_trip      save_adapter -> load_adapter into a new model: tensors and logits bit-exact
    peft_reads_ours our adapter loaded by peft.PeftModel.from_pretrained: logits max abs diff
    ours_reads_peft an adapter made by peft.get_peft_model: logits max abs diff
    merge           merged export vs peft merge_and_unload, tensor by tensor
    merge_to_hf     merge_adapter_into_hf output reloaded in transformers vs peft logits
    base_untouched  (qwen3) base weights bit-identical after 100 merged exports
    partial         (qwen3) targets q_proj + v_proj only
    errors          (qwen3, qwen3_moe) the UserError messages of bad adapters
    forward_only    (qwen3) a forward-only pass in train mode ignores LoRA dropout
    backward_ops    (qwen3) the matmul operators of a training forward + backward (no batched matmul)
    one_node        (qwen2, qwen3_moe) each LoRA linear as one autograd node, equal to megatron's
                    frozen linear plus the adapter branch (loss and gradients, with and without
                    dropout)
"""
import argparse
import json
import os

R, ALPHA = 4, 8
SEED = 11


# ---- models -----------------------------------------------------------------------------------

def mcore(hf_dir, state, lora=None, b_seed=SEED):
    """The Megatron model of `hf_dir` (loaded through the bridge), with adapters when `lora`."""
    import torch

    from lora_common import randomize_b
    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.lora import apply_lora
    from swift_megatron.model.config import load_hf_config

    hf_config = load_hf_config(hf_dir)
    loaded = load_mcore_model(hf_config, hf_config["model_type"], torch.float32, state, hf_dir=hf_dir)
    if lora is not None:
        apply_lora(loaded.model, lora, loaded.bridge.mappings)
        if b_seed is not None:
            randomize_b(loaded.model, b_seed)
    return loaded


def hf_model(hf_dir, adapter_dir=None):
    """The transformers model (a multimodal checkpoint's whole ConditionalGeneration model, whose
    module names, model.language_model.*, adapters use as ms-swift's do), + peft adapter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = hasattr(AutoConfig.from_pretrained(hf_dir), "vision_config")
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    import peft

    return peft.PeftModel.from_pretrained(model, adapter_dir).eval()


def hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


# ---- checks -----------------------------------------------------------------------------------

def _reference(x, reader, hf_module, adapters, scale):
    """x W^T (+ b) + scale * x A^T B^T from the HF-layout tensors."""
    import torch.nn.functional as F

    bias = reader.read(f"{hf_module}.bias") if f"{hf_module}.bias" in reader else None
    out = F.linear(x, reader.read(f"{hf_module}.weight"), bias)
    a, b = (adapters.get(f"base_model.model.{hf_module}.lora_{m}.weight") for m in "AB")
    return out if a is None else out + scale * F.linear(F.linear(x, a), b)


def _split_qkv(out, config):
    """Fused per-query-group [q, k, v] output -> (q, k, v), by hand."""
    hd, groups = config.kv_channels, config.num_query_groups
    q_rows = config.num_attention_heads // groups * hd
    grouped = out.reshape(*out.shape[:-1], groups, q_rows + 2 * hd)
    return [t.reshape(*out.shape[:-1], -1) for t in grouped.split([q_rows, hd, hd], dim=-1)]


def _split_gated_qkv(out, config):
    """Fused per-group [q heads | gate heads | k | v] -> (HF q_proj output, per head [q; gate],
    k, v), by hand."""
    import torch

    hd, groups = config.kv_channels, config.num_query_groups
    per_group = config.num_attention_heads // groups
    grouped = out.reshape(*out.shape[:-1], groups, 2 * per_group * hd + 2 * hd)
    q, gate, k, v = grouped.split([per_group * hd, per_group * hd, hd, hd], dim=-1)
    heads = (*out.shape[:-1], groups, per_group, 1, hd)
    q_proj = torch.cat([q.reshape(heads), gate.reshape(heads)], dim=-2)
    return [t.reshape(*out.shape[:-1], -1) for t in (q_proj, k, v)]


def _split_in_proj(out, config):
    """GDN in_proj output [q, k, v, z, b, a] (TP=1) -> HF in_proj_qkv, z, b, a outputs."""
    qkv = 2 * config.linear_key_head_dim * config.linear_num_key_heads \
        + config.linear_value_head_dim * config.linear_num_value_heads
    v, heads = config.linear_value_head_dim * config.linear_num_value_heads, \
        config.linear_num_value_heads
    return list(out.split([qkv, v, heads, heads], dim=-1))


def _chunks(out, config, parts):
    return list(out.chunk(parts, dim=-1))


def _linears(model, layer):
    """(mcore module, HF projections of its output chunks, how to split its output) of one
    layer: a Gated DeltaNet or a gated full-attention layer in hybrid models."""
    block = model.decoder.layers[layer]
    hybrid = model.config.attention_output_gate
    hf = f"model.language_model.layers.{layer}." if hybrid else f"model.layers.{layer}."
    mlp = block.mlp.experts.local_experts[0] if hasattr(block.mlp, "experts") else block.mlp
    mlp_hf = hf + ("mlp.experts.0." if hasattr(block.mlp, "experts") else "mlp.")
    one = lambda out, config: [out]  # noqa: E731
    two = lambda out, config: _chunks(out, config, 2)  # noqa: E731
    if hasattr(block.self_attention, "in_proj"):
        gdn = hf + "linear_attn."
        mixer = [(block.self_attention.in_proj, [gdn + p for p in ("in_proj_qkv", "in_proj_z",
                                                                   "in_proj_b", "in_proj_a")],
                  _split_in_proj),
                 (block.self_attention.out_proj, [gdn + "out_proj"], one)]
    else:
        mixer = [(block.self_attention.linear_qkv, [hf + f"self_attn.{p}_proj" for p in "qkv"],
                  _split_gated_qkv if hybrid else _split_qkv),
                 (block.self_attention.linear_proj, [hf + "self_attn.o_proj"], one)]
    return mixer + [(mlp.linear_fc1, [mlp_hf + "gate_proj", mlp_hf + "up_proj"], two),
                    (mlp.linear_fc2, [mlp_hf + "down_proj"], one)]


def check_projections(loaded, hf_dir, lora):
    import torch

    from lora_common import max_abs
    from swift_megatron.bridge.io import HFReader
    from swift_megatron.lora import adapter_state_dict

    reader, adapters = HFReader(hf_dir), adapter_state_dict(loaded.model)
    config, gen = loaded.model.config, torch.Generator().manual_seed(0)
    diffs = {}
    layers = (1, config.num_layers - 1) if config.attention_output_gate else (1,)
    with torch.no_grad():
        for layer in layers:  # hybrid: a Gated DeltaNet layer and the last (full) one
            for module, names, split in _linears(loaded.model, layer):
                x = torch.randn(5, 2, module.input_size, generator=gen)
                for name, part in zip(names, split(module(x)[0], config)):
                    diffs[name.split(f"layers.{layer}.")[1]] = max_abs(
                        part, _reference(x, reader, name, adapters, lora.scale))
    return diffs


def check_init(hf_dir, state, lora, tokens, base_logits):
    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import adapter_parameters

    loaded = mcore(hf_dir, state, lora, b_seed=None)
    trainable = {n for n, p in loaded.model.named_parameters() if p.requires_grad}
    return {"equal_base": bool((mcore_logits(loaded, tokens, state) == base_logits).all()),
            "trainable_are_adapters": trainable == set(adapter_parameters(loaded.model)),
            "num_trainable": len(trainable),
            "num_frozen": sum(1 for p in loaded.model.parameters() if not p.requires_grad)}


def check_disabled(loaded, state, tokens, base_logits):
    from lora_common import max_abs
    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import disabled

    with disabled(loaded.model):
        off = mcore_logits(loaded, tokens, state)
    on = mcore_logits(loaded, tokens, state)
    return {"equal_base": bool((off == base_logits).all()),
            "lora_moves_logits": max_abs(on, base_logits)}


def check_round_trip(loaded, hf_dir, state, lora, tokens, out_dir):
    import torch

    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import adapter_state_dict, load_adapter, save_adapter

    save_adapter(loaded.model, out_dir, hf_dir, lora)
    fresh = mcore(hf_dir, state)
    load_adapter(fresh.model, out_dir, fresh.bridge)
    before, after = adapter_state_dict(loaded.model), adapter_state_dict(fresh.model)
    with open(os.path.join(out_dir, "adapter_config.json")) as f:
        saved_config = json.load(f)
    return {"same_names": sorted(before) == sorted(after),
            "bit_exact": all(torch.equal(before[k], after[k]) for k in before),
            "num_tensors": len(before),
            "same_logits": bool((mcore_logits(fresh, tokens, state)
                                 == mcore_logits(loaded, tokens, state)).all()),
            "config": {k: saved_config[k] for k in ("r", "lora_alpha", "target_modules",
                                                     "peft_type", "task_type", "use_rslora")}}


def check_peft_reads_ours(loaded, hf_dir, state, tokens, adapter_dir):
    from lora_common import max_abs
    from swift_megatron.export import mcore_logits

    ours = mcore_logits(loaded, tokens, state)
    theirs = hf_logits(hf_model(hf_dir, adapter_dir), tokens)
    base = hf_logits(hf_model(hf_dir), tokens)
    return {"max_abs_diff": max_abs(ours, theirs), "lora_effect": max_abs(theirs, base)}


def make_peft_adapter(hf_dir, out_dir, target_modules, use_rslora=False):
    """An adapter created by peft itself, with random nonzero B."""
    import peft
    import torch

    model = peft.get_peft_model(hf_model(hf_dir), peft.LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=target_modules, use_rslora=use_rslora,
        task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(out_dir)
    return model.eval()


def check_ours_reads_peft(hf_dir, state, tokens, out_dir, target_modules):
    from lora_common import max_abs
    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import load_adapter

    peft_model = make_peft_adapter(hf_dir, out_dir, target_modules, use_rslora=True)
    loaded = mcore(hf_dir, state)
    config = load_adapter(loaded.model, out_dir, loaded.bridge)
    ours = mcore_logits(loaded, tokens, state)
    return {"max_abs_diff": max_abs(ours, hf_logits(peft_model, tokens)),
            "loaded_targets": list(config.projections()), "use_rslora": config.use_rslora}


def _hf_per_expert(state_dict):
    """transformers 5 fused experts -> the per-expert hub names the bridge exports."""
    out = {}
    for name, tensor in state_dict.items():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            out.update({f"{prefix}.{e}.down_proj.weight": t for e, t in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


def check_merge(loaded, hf_dir, adapter_dir):
    from lora_common import max_abs

    merged_peft = _hf_per_expert(hf_model(hf_dir, adapter_dir).merge_and_unload().state_dict())
    exported = dict(loaded.bridge.export(loaded.model))
    outside = {n for n in merged_peft if n.startswith(tuple(loaded.bridge.passthrough))}
    return {"max_abs_diff": max(max_abs(t, merged_peft[n]) for n, t in exported.items()),
            "num_tensors": len(exported),
            "lora_in_export": [n for n in exported if "lora" in n],
            "missing": sorted(set(merged_peft) - set(exported) - outside - {"lm_head.weight"})}


def check_merge_to_hf(hf_dir, adapter_dir, state, tokens, out_dir):
    from lora_common import max_abs
    from swift_megatron.export import merge_adapter_into_hf

    merge_adapter_into_hf(hf_dir, adapter_dir, out_dir, state)
    merged = hf_logits(hf_model(out_dir), tokens)
    return {"max_abs_diff_vs_peft": max_abs(merged, hf_logits(hf_model(hf_dir, adapter_dir), tokens))}


def check_base_untouched(loaded, exports=100):
    from swift_megatron.lora import adapter_parameters

    adapters = set(adapter_parameters(loaded.model))
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if n not in adapters}
    for _ in range(exports):
        for _name, _tensor in loaded.bridge.export(loaded.model):
            pass
    after = dict(loaded.model.named_parameters())
    return {"exports": exports, "bit_identical": all(
        before[n].dtype == after[n].dtype and bool((before[n] == after[n]).all()) for n in before)}


def _qkv_of(loaded, x):
    linear = loaded.model.decoder.layers[0].self_attention.linear_qkv
    return _split_qkv(linear(x)[0], loaded.model.config)


def check_partial(hf_dir, state, out_dir):
    import torch

    from swift_megatron.lora import LoraConfig, lora_modules, save_adapter

    lora = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=("q_proj", "v_proj"), seed=SEED)
    loaded, base = mcore(hf_dir, state, lora), mcore(hf_dir, state)
    x = torch.randn(3, 1, loaded.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        (q, k, v), (q0, k0, v0) = _qkv_of(loaded, x), _qkv_of(base, x)
    save_adapter(loaded.model, out_dir, hf_dir, lora)
    with open(os.path.join(out_dir, "adapter_config.json")) as f:
        targets = json.load(f)["target_modules"]
    return {"adapted_modules": len(lora_modules(loaded.model)), "k_equal_base": bool((k == k0).all()),
            "q_moved": bool((q != q0).any()), "v_moved": bool((v != v0).any()), "targets": targets}


def check_backward_ops(loaded):
    """The matmuls of a LoRA forward + backward as training runs it (the final hidden states
    into the output layer's chunked logprobs, model/head.py) on a padded batch (b = 2) and on
    one row (b = 1, as packed sequences are): plain matrix products only, no batched matmul
    (`aten::bmm`: megatron's frozen output layer ran one per position on a transposed logit
    gradient, 240 ms per micro-batch on an H100, docs/gpu.md)."""
    import torch
    from torch.profiler import profile

    from swift_megatron.model.head import FinalHidden, hidden_states_out

    ops = {}
    for rows in (2, 1):
        tokens = torch.randint(0, 100, (rows, 16), generator=torch.Generator().manual_seed(0))
        with profile() as prof:
            with hidden_states_out(loaded.model):
                hidden = loaded.model(tokens, torch.arange(16).expand(rows, 16), None)
            FinalHidden(hidden, loaded.model).logprobs(tokens, 1.0, 100).sum().backward()
        loaded.model.zero_grad()
        ops[f"b{rows}"] = sorted({e.key for e in prof.key_averages()} & {"aten::bmm", "aten::mm"})
    return ops


def _autograd_nodes(root, name: str) -> int:
    """How many nodes named `name` the autograd graph under `root` holds."""
    seen, stack, count = set(), [root], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == name
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


def check_one_node(hf_dir, state):
    """At one rank each LoRA linear runs as one autograd node (lora/branch.py
    FrozenLinearWithAdapter) instead of megatron's frozen linear plus the adapter branch; both
    give the same loss and gradients, with dropout (the same masks: one draw per linear, in the
    same order) and without. The relative differences, the count of one-node linears in each
    graph and the number of adapted linears."""
    import torch

    from swift_megatron.lora import LoraConfig
    from swift_megatron.lora.layers import _LoraMixin, lora_modules
    from swift_megatron.model.head import FinalHidden, hidden_states_out

    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    result = {}
    for dropout in (0.0, 0.1):
        loaded = mcore(hf_dir, state, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=dropout,
                                                 target_modules=("all-linear",), seed=SEED))
        model, runs = loaded.model.train(), []
        for one_node in (True, False):
            original = _LoraMixin._fuses
            if not one_node:
                _LoraMixin._fuses = lambda self, weight: False
            try:
                torch.manual_seed(0)
                with hidden_states_out(model):
                    hidden = model(tokens, torch.arange(16).expand(2, 16), None)
                loss = FinalHidden(hidden, model).logprobs(tokens, 1.0, 100).sum()
                nodes = _autograd_nodes(loss.grad_fn, "FrozenLinearWithAdapterBackward")
                loss.backward()
            finally:
                _LoraMixin._fuses = original
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad()
            runs.append((loss.detach(), grads, nodes))
        (loss1, grads1, nodes1), (loss2, grads2, nodes2) = runs
        result[str(dropout)] = dict(
            loss=float((loss1 - loss2).abs() / loss2.abs()),
            same_params=grads1.keys() == grads2.keys(),
            grads=max(float((grads1[n] - grads2[n]).abs().max()
                            / grads2[n].abs().max().clamp_min(1e-12)) for n in grads2),
            nodes_one=nodes1, nodes_two=nodes2, linears=len(lora_modules(model)))
    return result


def check_forward_only_is_deterministic(hf_dir, state, tokens):
    """A forward-only pass (old-policy / reference / weight-sync logprobs) of a model in train
    mode with LoRA dropout 0.5 gives the same logits twice (dropout off) and leaves the model in
    train mode."""
    from swift_megatron.export import mcore_logits
    from swift_megatron.lora import LoraConfig

    lora = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.5, target_modules=("all-linear",),
                      seed=SEED)
    loaded = mcore(hf_dir, state, lora)
    loaded.model.train()
    first, second = (mcore_logits(loaded, tokens, state) for _ in range(2))
    return {"equal": bool((first == second).all()), "still_training": loaded.model.training}


def _user_error(fn):
    from swift_megatron.errors import UserError

    try:
        fn()
    except UserError as e:
        return str(e)
    return None


def _edit_config(adapter_dir, out_dir, **changes):
    import shutil

    shutil.copytree(adapter_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "adapter_config.json")
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)
    return out_dir


def check_errors(hf_dir, state, adapter_dir, work):
    from swift_megatron.lora import LoraConfig, apply_lora, load_adapter

    def load_into(directory, lora=None):
        def run():
            loaded = mcore(hf_dir, state)
            if lora is not None:
                apply_lora(loaded.model, lora)
            load_adapter(loaded.model, directory)
        return run

    def edited(name, **changes):
        return _edit_config(adapter_dir, os.path.join(work, name), **changes)

    return {
        "missing_dir": _user_error(load_into(os.path.join(work, "nowhere"))),
        "rank_mismatch": _user_error(load_into(adapter_dir,
                                               LoraConfig(r=2 * R, lora_alpha=2 * ALPHA))),
        "unknown_target": _user_error(load_into(edited("unknown", target_modules=["q_proj"]))),
        "unsupported_target": _user_error(load_into(edited("lm_head",
                                                           target_modules=["q_proj", "lm_head"]))),
        "wrong_shape": _user_error(load_into(edited("r8", r=2 * R))),
    }


def check_peft_fused_experts(hf_dir, state, out_dir):
    """peft on transformers 5 adapts fused experts as parameters: we reject that format."""
    make_peft_adapter(hf_dir, out_dir, ["q_proj", "gate_proj", "up_proj", "down_proj"])
    with open(os.path.join(out_dir, "adapter_config.json")) as f:
        saved = json.load(f)

    def run():
        from swift_megatron.lora import load_adapter

        loaded = mcore(hf_dir, state)
        load_adapter(loaded.model, out_dir, loaded.bridge)
    return {"error": _user_error(run),
            "target_parameters": sorted(saved.get("target_parameters") or [])}


# ---- driver -----------------------------------------------------------------------------------

def run_family(family, root, out, state):
    from swift_megatron.export import mcore_logits, random_tokens
    from swift_megatron.fixtures import build_tiny_model
    from swift_megatron.lora import LoraConfig

    hf_dir = os.path.join(root, family)
    if not os.path.isdir(hf_dir):
        build_tiny_model(family, hf_dir)
    work = os.path.join(out, family)
    tokens = random_tokens(500, 64, "cpu")
    lora = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=("all-linear",), seed=SEED)
    base_logits = mcore_logits(mcore(hf_dir, state), tokens, state)
    loaded = mcore(hf_dir, state, lora)
    adapter_dir = os.path.join(work, "ours")
    result = {
        "projections": check_projections(loaded, hf_dir, lora),
        "init": check_init(hf_dir, state, lora, tokens, base_logits),
        "disabled": check_disabled(loaded, state, tokens, base_logits),
        "round_trip": check_round_trip(loaded, hf_dir, state, lora, tokens, adapter_dir),
        "peft_reads_ours": check_peft_reads_ours(loaded, hf_dir, state, tokens, adapter_dir),
        "merge": check_merge(loaded, hf_dir, adapter_dir),
        "merge_to_hf": check_merge_to_hf(hf_dir, adapter_dir, state, tokens,
                                         os.path.join(work, "merged")),
    }
    from swift_megatron.lora import HF_PROJECTIONS

    dense = family not in ("qwen3_moe", "qwen3_5_moe")
    peft_targets = "all-linear" if dense else ["q_proj", "k_proj", "v_proj", "o_proj"]
    if family.startswith("qwen3_5"):  # peft's all-linear would adapt the vision tower too
        peft_targets = list(HF_PROJECTIONS) if dense else peft_targets + ["in_proj_qkv"]
    result["ours_reads_peft"] = check_ours_reads_peft(hf_dir, state, tokens,
                                                      os.path.join(work, "peft"), peft_targets)
    if family == "qwen3":
        result["base_untouched"] = check_base_untouched(loaded)
        result["backward_ops"] = check_backward_ops(loaded)
        result["forward_only"] = check_forward_only_is_deterministic(hf_dir, state, tokens)
        result["partial"] = check_partial(hf_dir, state, os.path.join(work, "partial"))
        result["errors"] = check_errors(hf_dir, state, adapter_dir, work)
    if family in ("qwen2", "qwen3_moe"):
        result["one_node"] = check_one_node(hf_dir, state)
    if not dense:
        result["peft_fused_experts"] = check_peft_fused_experts(hf_dir, state,
                                                                os.path.join(work, "fused"))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--root")
    parser.add_argument("--families", nargs="+", default=["qwen3", "qwen2", "llama", "qwen3_moe"])
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    from swift_megatron.parallel.state import ParallelState

    hf_logging.set_verbosity_error()
    state = ParallelState.initialize(device="cpu", seed=0)
    results = {family: run_family(family, args.root, args.out_dir, state) for family in args.families}
    with open(os.path.join(args.out_dir, "rank0.json"), "w") as f:
        json.dump(results, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
