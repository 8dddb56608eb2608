"""Worker for the offload tests (tests/vllm/test_offload.py, tests/gpu/test_vllm_gpu.py): Adam
steps on a tiny Qwen3-shaped Megatron model, with the model and optimizer offloaded to host
memory and reloaded between the steps (--offload 1) or not (--offload 0). Prints one JSON line:
losses, a parameter checksum, and for the offloaded run whether every reload was bit-identical
and how much device memory the offload freed.

    python tests/vllm/offload_worker.py --offload 1 --dist_opt 1 --device cpu
"""
import argparse
import json
import os
import sys

import torch
from megatron.core import tensor_parallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from swift_megatron.model.build import build_model  # noqa: E402
from swift_megatron.parallel.state import ParallelState  # noqa: E402
from swift_megatron.training.offload import model_offloader, optimizer_offloader  # noqa: E402
from swift_megatron.training.optim import (OptimizerSettings, build_optimizer,  # noqa: E402
                                           build_scheduler, wrap_ddp)
from swift_megatron.training.step import forward_backward, optimizer_step, zero_grads  # noqa: E402

HF = dict(model_type="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
          tie_word_embeddings=True)
STEPS, BATCH, SEQ = 3, 4, 16


def micro_batches(step: int, device):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, HF["vocab_size"], (BATCH, SEQ + 1), generator=gen).to(device)
    return [dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                 position_ids=torch.arange(SEQ, device=device).expand(BATCH, SEQ))]


def loss_fn(mb, output):
    logits = output.logits()
    per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb["labels"])
    loss = per_token.mean()
    return loss, {"loss": loss.detach()}


def snapshot(ddp, optimizer):
    tensors = [p.detach().clone() for p in ddp.parameters()]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            tensors += [t.detach().clone() for t in state.values() if torch.is_tensor(t)]
        tensors += [p.detach().clone() for g in opt.optimizer.param_groups for p in g["params"]]
    return tensors


def offload_round(ddp, optimizer, offloaders) -> dict:
    """Offload and reload once; check the bytes came back and what was freed meanwhile."""
    before = snapshot(ddp, optimizer)
    allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    freed = sum(o.offload() for o in offloaders)
    emptied = all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters())
    allocated_off = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    for o in offloaders:
        o.reload()
    after = snapshot(ddp, optimizer)
    identical = all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after)
    return dict(freed_bytes=freed, params_emptied=emptied, identical=identical,
                cuda_allocated_before=allocated, cuda_allocated_offloaded=allocated_off)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--offload", type=int, default=1)
    parser.add_argument("--dist_opt", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    a = parser.parse_args()
    st = ParallelState.initialize(device=a.device, seed=1234)
    dtype = getattr(torch, a.dtype)
    model, cfg, _ = build_model(HF, dtype, st.device)
    ddp = wrap_ddp(model, cfg, bool(a.dist_opt))
    settings = OptimizerSettings(lr=1e-3, use_distributed_optimizer=bool(a.dist_opt),
                                 train_iters=STEPS)
    optimizer = build_optimizer([ddp], cfg, settings)
    scheduler = build_scheduler(optimizer, settings)
    offloaders = [model_offloader([ddp]), optimizer_offloader(optimizer)]
    losses, rounds = [], []
    for step in range(STEPS):
        zero_grads([ddp], optimizer)
        outputs = forward_backward([ddp], micro_batches(step, st.device), loss_fn)
        optimizer_step(optimizer, scheduler)
        losses.append(float(outputs[0]["loss"]))
        if a.offload:
            rounds.append(offload_round(ddp, optimizer, offloaders))
    checksum = float(sum(p.double().sum() for p in ddp.parameters()))
    print(json.dumps(dict(losses=losses, checksum=checksum, rounds=rounds)), flush=True)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
