"""Worker (one process, CPU): flags that change the model or its optimizer, through the code the
trainer runs (the parsed flags -> components.py -> megatron); writes {out_dir}/rank0.json for
tests/unit/test_model_flags.py.

    python -m torch.distributed.run --nproc_per_node 1 tests/distributed/workers/model_flags.py \\
        --out_dir OUT --moe_dir TINY_QWEN3_MOE --vl_dir TINY_QWEN2_5_VL

Checks:
    capacity     --moe_expert_capacity_factor on the tiny qwen3_moe (8 experts, top 2), policy
                 and reference built by components.py: the config megatron got, the tokens each
                 layer's router kept, the logits against the no-drop model's, one backward pass
    adam_eps     one optimizer step (the distributed optimizer, as the flags default to) with
                 --adam_eps 1e-3, --weight_decay 0, --clip_grad 0: every parameter's update
                 against Adam's first step, -lr * g / (|g| + eps), for that eps and for 1e-8
    vision_lrs   the tiny qwen2_5_vl, policy built by components.policy() with --freeze_vit false
                 --freeze_aligner false --vit_lr --aligner_lr, one step on two sequences with an
                 image each: each part's update against Adam's first step at its own learning
                 rate and at --lr, and the peak/minimum learning rates of its optimizer groups
"""
import argparse
import json
import os
from types import SimpleNamespace

import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.checkpoint.start import Start
from swift_megatron.checkpoint.loaded_model import LoadedModel
from swift_megatron.export import mcore_logits
from swift_megatron.model.config import load_hf_config
from swift_megatron.parallel.state import ParallelState
from swift_megatron.rlhf.grpo import components
from swift_megatron.training.optim import build_optimizer, build_scheduler, wrap_ddp
from swift_megatron.training.step import forward_backward, optimizer_step, zero_grads

BATCH, SEQ = 2, 24          # 48 tokens per micro-batch: 96 expert slots at top 2


def flags(model_dir: str, *extra) -> RlhfArguments:
    return parse_command(RlhfArguments, ["--model", model_dir, "--dataset", "unused", *extra],
                         "megatron rlhf")


def tokens_for(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def load(args, state, model_dir):
    """components.py's model: the policy's (and the reference's) build and weights."""
    hf_config = load_hf_config(model_dir)
    chunks, config, bridge = components._load_model(args, state, model_dir, hf_config,
                                                    torch.float32, None)
    return chunks[0], config, bridge  # one chunk: no interleaved pipeline here


def routed_counter(model):
    """Token-expert assignments each router kept in the last forward (hooks on the routers)."""
    counts = {}

    def hook(index):
        def record(module, inputs, output):
            counts[index] = int(output[1].sum())   # (probs, routing_map [tokens, experts])
        return record

    for index, layer in enumerate(model.decoder.layers):
        layer.mlp.router.register_forward_hook(hook(index))
    return counts


def logits_of(model, bridge, state, tokens):
    return mcore_logits(LoadedModel(model.eval(), bridge, bridge.shape, torch.float32), tokens,
                        state)


def capacity_case(model_dir, state, factor, tokens):
    extra = [] if factor is None else ["--moe_expert_capacity_factor", str(factor)]
    args = flags(model_dir, *extra)
    model, config, bridge = load(args, state, model_dir)
    counts = routed_counter(model)
    logits = logits_of(model, bridge, state, tokens)
    summary = dict(capacity_factor=config.moe_expert_capacity_factor,
                   drop_policy=config.moe_token_drop_policy,
                   dispatcher=config.moe_token_dispatcher_type,
                   grouped_gemm=config.moe_grouped_gemm,
                   routed=[counts[i] for i in sorted(counts)])
    return args, model, bridge, logits, summary


def reference_logits(args, state, model_dir, bridge, tokens):
    """Logits of components.reference_model() for this policy (beta > 0, full training)."""
    policy = SimpleNamespace(lora=None, model_dir=model_dir, hf_config=load_hf_config(model_dir),
                             dtype=torch.float32, chunks=[])
    reference = components.reference_model(args, state, policy, Start(None, None, None),
                                           tok=None)
    [model] = reference.frozen
    return logits_of(model, bridge, state, tokens), model.config.moe_expert_capacity_factor


def backward_with_drops(model, tokens):
    """One forward/backward through megatron's schedule with tokens dropped: grads finite."""
    model.train()
    batch = dict(tokens=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ).contiguous())
    forward_backward([model], [batch], lambda mb, output: (output.logits().float().pow(2).mean(), {}))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return dict(params_with_grad=len(grads),
                all_finite=all(bool(torch.isfinite(g).all()) for g in grads))


def check_capacity(model_dir, state):
    vocab = load_hf_config(model_dir)["vocab_size"]
    tokens = tokens_for(vocab)
    report = {}
    _, _, _, base, report["none"] = capacity_case(model_dir, state, None, tokens)
    _, _, _, large, report["large"] = capacity_case(model_dir, state, 4.0, tokens)
    args, model, bridge, small, report["small"] = capacity_case(model_dir, state, 0.5, tokens)
    report["large_equals_none"] = bool(torch.equal(large, base))
    report["small_max_abs_diff"] = float((small - base).abs().max())
    ref, ref_factor = reference_logits(args, state, model_dir, bridge, tokens)
    report["reference_factor"] = ref_factor
    report["reference_equals_policy"] = bool(torch.equal(ref, small))
    report["backward"] = backward_with_drops(model, tokens)
    return report


def check_adam_eps(model_dir, state, eps=1e-3, lr=1e-3):
    args = flags(model_dir, "--adam_eps", str(eps), "--lr", str(lr), "--weight_decay", "0",
                 "--clip_grad", "0", "--lr_decay_style", "constant")
    settings = components.optimizer_settings(args, iters=1)
    model, config, _ = load(args, state, model_dir)
    ddp = wrap_ddp(model, config, settings.use_distributed_optimizer)
    optimizer = build_optimizer([ddp], config, settings)
    scheduler = build_scheduler(optimizer, settings)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = dict(tokens=tokens_for(load_hf_config(model_dir)["vocab_size"]),
                 position_ids=torch.arange(SEQ).expand(BATCH, SEQ).contiguous())
    zero_grads([ddp], optimizer)
    forward_backward([ddp], [batch], lambda mb, output: (output.logits().float().pow(2).mean(), {}))
    optimizer_step(optimizer, scheduler)
    errors = {"flag_eps": 0.0, "default_eps": 0.0}
    for name, param in model.named_parameters():
        grad, delta = param.main_grad, param.detach() - before[name]
        for key, e in (("flag_eps", eps), ("default_eps", 1e-8)):
            expected = -lr * grad / (grad.abs() + e)
            errors[key] = max(errors[key], float((delta - expected).abs().max()))
    return dict(settings_eps=settings.adam_eps, distributed=settings.use_distributed_optimizer,
                max_update_error=errors)


def image_batch(hf_config):
    """One micro-batch of two sequences with an image each (vision_checks.py's inputs), with
    1-D positions (equal on the three M-RoPE axes: enough for a gradient)."""
    from tests.distributed.workers.vision_checks import SEQ as VL_SEQ, inputs

    ids, pixels, grid, _ = inputs(hf_config)
    return dict(tokens=ids, position_ids=torch.arange(VL_SEQ).expand(2, VL_SEQ).contiguous(),
                pixel_values=pixels, image_grid_thw=grid)


def check_vision_lrs(model_dir, state, lr=1e-3, vit_lr=1e-4, aligner_lr=1e-2, min_lr=1e-4):
    from swift_megatron.model.vision import vision_part

    args = flags(model_dir, "--freeze_vit", "false", "--freeze_aligner", "false", "--lr", str(lr),
                 "--vit_lr", str(vit_lr), "--aligner_lr", str(aligner_lr), "--min_lr", str(min_lr),
                 "--weight_decay", "0", "--clip_grad", "0", "--lr_decay_style", "constant")
    pol = components.policy(args, state, model_dir, 1, Start(None, None, None))
    [model] = [chunk.module for chunk in pol.chunks]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero_grads(pol.chunks, pol.optimizer)
    forward_backward(pol.chunks, [image_batch(pol.hf_config)],
                     lambda mb, output: (output.logits().float().pow(2).mean(), {}))
    optimizer_step(pol.optimizer, pol.scheduler)
    part_lr = {"vit": vit_lr, "aligner": aligner_lr, "llm": lr}
    report = {part: {"own_lr_error": 0.0, "base_lr_error": 0.0, "max_update": 0.0}
              for part in part_lr}
    for name, param in model.named_parameters():
        grad, delta = param.main_grad, param.detach() - before[name]
        part = report[vision_part(name)]
        for key, rate in (("own_lr_error", part_lr[vision_part(name)]), ("base_lr_error", lr)):
            expected = -rate * grad / (grad.abs() + 1e-8)
            part[key] = max(part[key], float((delta - expected).abs().max()))
        part["max_update"] = max(part["max_update"], float(delta.abs().max()))
    groups = sorted({(g["max_lr"], g["min_lr"]) for g in pol.optimizer.param_groups
                     if g["params"]})
    return dict(parts=report, group_lrs=[list(g) for g in groups])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--moe_dir")
    parser.add_argument("--vl_dir")
    a = parser.parse_args()
    state = ParallelState.initialize(device="cpu", seed=1234)
    report = {"capacity": check_capacity(a.moe_dir, state),
              "adam_eps": check_adam_eps(a.moe_dir, state),
              "vision_lrs": check_vision_lrs(a.vl_dir, state)}
    with open(os.path.join(a.out_dir, "rank0.json"), "w") as f:
        json.dump(report, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
