"""Worker: the output layer's logprobs (values and the gradients of the hidden states and of the
weight) and entropy (values), with the weight's vocabulary rows split over TP ranks (`--sp`: the
hidden states split over the sequence too, sequence parallelism; `--compile`: the chunk math
compiled by torch.compile). Goes through model/head.py's FinalHidden, as the loss callbacks do;
writes values and the gathered gradients to {out_dir}/rank{R}.json. Also: the weight gradient
added into a megatron-DDP-style `main_grad` instead of returned, and a classic wrong version (a
log-softmax with autograd all_reduces) for comparison."""
import argparse
import json
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from swift_megatron.model import logprobs
from swift_megatron.model.head import FinalHidden
from swift_megatron.parallel.state import ParallelState

VOCAB, PADDED, HIDDEN, TEMPERATURE = 9, 10, 4, 0.7
SEQ, BATCH = 6, 2
CHUNK = 5  # tokens per forward chunk: the 12 positions take three chunks, the last one short


def inputs():
    """hidden [s, b, h] (megatron's layout), weight [padded vocab, h], targets and the weights
    of the logprobs in the loss, [b, s]."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64).float()
    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64).float() * 1.5
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return hidden, weight, targets, torch.randn(BATCH, SEQ, generator=gen)


def naive_logprobs(local, targets, start):
    """Wrong on purpose: a log-softmax whose all_reduces are autograd ops. The loss is
    replicated on every TP rank, so the all_reduce in backward sums TP identical gradients."""
    from torch.distributed.nn.functional import all_reduce

    scaled = local / TEMPERATURE
    total = all_reduce(torch.exp(scaled).sum(-1))
    in_shard = (targets >= start) & (targets < start + local.shape[-1])
    picked = scaled.gather(-1, (targets - start).clamp(0, local.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = all_reduce(torch.where(in_shard, picked, 0.0))
    return picked - torch.log(total)


def gathered(tensor, dim):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=dim)


def output(hidden, weight, sequence_parallel):
    model = SimpleNamespace(config=SimpleNamespace(sequence_parallel=sequence_parallel),
                            share_embeddings_and_output_weights=False,
                            output_layer=SimpleNamespace(weight=weight))
    return FinalHidden(hidden, model)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--compile", action="store_true", help="torch.compile the chunk math")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    args = parser.parse_args()
    out_dir = args.out_dir
    logprobs.KERNELS.set_mode(args.compile)
    st = ParallelState.initialize(tp=dist.get_world_size() if dist.is_initialized() else
                                  int(os.environ["WORLD_SIZE"]), device="cpu")
    hidden, weight, targets, w_lp = inputs()
    width, rows = PADDED // st.tp, SEQ // st.tp
    w_local = weight[st.tp_rank * width:(st.tp_rank + 1) * width].clone().requires_grad_(True)
    h_local = (hidden[st.tp_rank * rows:(st.tp_rank + 1) * rows] if args.sp else hidden)
    h_local = h_local.clone().requires_grad_(True)
    with _chunk(CHUNK):
        lp, ent = output(h_local, w_local, args.sp).logprobs(targets, TEMPERATURE, VOCAB, True)
        assert not ent.requires_grad
        (lp * w_lp).sum().backward()
        # the weight gradient into a float32 main_grad (megatron DDP) instead of returned
        w_ddp = w_local.detach().clone().requires_grad_(True)
        w_ddp.main_grad = torch.full(w_ddp.shape, 0.5)
        lp2 = output(h_local.detach(), w_ddp, args.sp).logprobs(targets, TEMPERATURE, VOCAB)
        (lp2 * w_lp).sum().backward()
    h_grad = gathered(h_local.grad, 0) if args.sp else h_local.grad
    result = dict(logprobs=lp.tolist(), entropy=ent.tolist(), hidden_grad=h_grad.tolist(),
                  weight_grad=gathered(w_local.grad, 0).tolist(),
                  main_grad=gathered(w_ddp.main_grad - 0.5, 0).tolist(),
                  ddp_grad_returned=w_ddp.grad is not None,
                  compiled=logprobs.KERNELS.ran_compiled)
    local = (hidden.transpose(0, 1) @ w_local.detach().t()).requires_grad_(True)
    (naive_logprobs(local, targets, st.tp_rank * width) * w_lp).sum().backward()
    result["naive_grad"] = gathered(local.grad, -1).tolist()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    ParallelState.destroy()


class _chunk:
    """head_logprobs' default chunk set to `tokens` inside the block."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __enter__(self):
        self.saved = logprobs.CHUNK_BYTES
        logprobs.CHUNK_BYTES = self.tokens * 4 * (PADDED // dist.get_world_size())

    def __exit__(self, *exc):
        logprobs.CHUNK_BYTES = self.saved


if __name__ == "__main__":
    main()
