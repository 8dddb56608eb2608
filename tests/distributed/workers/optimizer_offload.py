"""Worker (one process, CUDA): megatron's optimizer host offload as swift-megatron builds it, and
the bf16 Adam moments.

    python -m torch.distributed.run --nproc_per_node 1 \\
        tests/distributed/workers/optimizer_offload.py --out_dir OUT

A tiny Qwen3-shaped model in bf16 with the distributed optimizer trains 4 Adam steps of
next-token cross-entropy from the same initial weights in each variant:

    plain            the optimizer on the GPU (fp32 main params, torch AdamW)
    offload          --optimizer_cpu_offload --use_precision_aware_optimizer (fraction 1,
                     ms-swift's example)
    offload_half     the same with --optimizer_offload_fraction 0.5
    offload_colocate the same as offload, with --offload_optimizer's offload/reload around
                     every step (what colocate mode does while vLLM generates); reports the
                     bytes each offload moved (GPU memory only: the host state stays put)
    bf16_moments     --use_precision_aware_optimizer --exp_avg_dtype bf16 --exp_avg_sq_dtype
                     bf16 on the GPU (training/adam_states.py)

Each variant reports its losses, grad norms, the bytes of the Adam moments and of the float32
master params on the GPU and on the host, and the max |param - plain's param| at the end;
{out_dir}/rank0.json holds {variant: report}. tests/gpu/test_optimizer_offload_gpu.py checks them.
"""
import argparse
import json
import os

import torch
from megatron.core import tensor_parallel

from swift_megatron.model.build import build_model
from swift_megatron.parallel.state import ParallelState
from swift_megatron.training.offload import optimizer_offloader
from swift_megatron.training.optim import (OptimizerSettings, build_optimizer, build_scheduler,
                                           check_settings, wrap_ddp)
from swift_megatron.training.step import forward_backward, optimizer_step, zero_grads

HF = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
          rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
          tie_word_embeddings=False)
BATCH, SEQ, STEPS = 4, 32, 4
OFFLOAD = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True)
VARIANTS = {
    "plain": dict(),
    "offload": OFFLOAD,
    "offload_half": dict(OFFLOAD, optimizer_offload_fraction=0.5),
    "offload_colocate": OFFLOAD,
    "bf16_moments": dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
                         exp_avg_sq_dtype="bf16"),
}


def batches(device):
    gen = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        tokens = torch.randint(0, HF["vocab_size"], (BATCH, SEQ + 1), generator=gen).to(device)
        yield [dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                    position_ids=torch.arange(SEQ, device=device).expand(BATCH, SEQ))]


def loss_fn(mb, output):
    logits = output.logits()
    per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb["labels"])
    loss = per_token.mean()
    return loss, {"loss": loss.detach()}


def _bytes_by_device(tensors):
    found = {"cuda": 0, "cpu": 0}
    for tensor in {id(t): t for t in tensors}.values():
        found[tensor.device.type] += tensor.numel() * tensor.element_size()
    return found


def state_bytes(optimizer):
    """Bytes of the Adam moments and of the float32 master params, by device type, and the
    class of megatron's inner torch optimizer."""
    inner = optimizer.chained_optimizers[0].optimizer if hasattr(
        optimizer, "chained_optimizers") else optimizer.optimizer
    subs = getattr(inner, "sub_optimizers", [inner])
    moments = [t for opt in subs for per_param in opt.state.values()
               for key, t in per_param.items() if key in ("exp_avg", "exp_avg_sq")]
    masters = [p for opt in [inner, *subs] for group in opt.param_groups
               for p in group["params"] if p.dtype == torch.float32]
    return dict(moments=_bytes_by_device(moments), master_params=_bytes_by_device(masters),
                inner_optimizer=type(inner).__name__,
                fused=all(group.get("fused") for group in inner.param_groups))


def train(state, name, flags):
    state.seed(1234)
    model, config, _ = build_model(HF, torch.bfloat16, state.device)
    settings = OptimizerSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0, train_iters=STEPS,
                                 use_distributed_optimizer=True, lr_decay_style="constant",
                                 **flags)
    check_settings(settings, state.device, torch.bfloat16)
    ddp = wrap_ddp(model, config, True)
    optimizer = build_optimizer([ddp], config, settings)
    scheduler = build_scheduler(optimizer, settings)
    offloader = optimizer_offloader(optimizer) if name.endswith("colocate") else None
    losses, norms, moved = [], [], []
    for micro in batches(state.device):
        if offloader is not None:
            moved.append(offloader.offload())
            offloader.reload()
        zero_grads([ddp], optimizer)
        outputs = forward_backward([ddp], micro, loss_fn)
        _, norm = optimizer_step(optimizer, scheduler)
        losses.append(float(outputs[0]["loss"]))
        norms.append(norm)
    params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    return dict(losses=losses, grad_norms=norms, offloaded_bytes=moved,
                **state_bytes(optimizer)), params


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--device", default="cuda", help="cpu: the plain variant only")
    a = parser.parse_args()
    state = ParallelState.initialize(device=a.device, seed=1234)
    report, reference = {}, None
    for name in a.variants:
        report[name], params = train(state, name, VARIANTS[name])
        reference = reference or params
        report[name]["max_param_diff_vs_plain"] = max(
            float((params[n] - reference[n]).abs().max()) for n in params)
        print(name, json.dumps(report[name]), flush=True)
    with open(os.path.join(a.out_dir, "rank0.json"), "w") as f:
        json.dump(report, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
