"""Worker: vocab-parallel logprobs (values and gradients) and entropy (values) on a fixed logits
tensor split over TP ranks (`--compile`: the chunk math compiled by torch.compile); writes values
and the gathered gradient to {out_dir}/rank{R}.json. Also computes a classic wrong version
(log-softmax with autograd all_reduces) for comparison."""
import argparse
import json
import os

import torch
import torch.distributed as dist

from swift_megatron.model import logprobs
from swift_megatron.model.logprobs import vocab_parallel_logprobs
from swift_megatron.parallel.state import ParallelState

VOCAB, PADDED, TEMPERATURE = 9, 10, 0.7
CHUNK = 3  # tokens per chunk: the 10 positions take four chunks, the last one short


def inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, PADDED, generator=gen, dtype=torch.float64).float() * 3
    targets = torch.randint(0, VOCAB, (2, 5), generator=gen)
    return logits, targets, torch.randn(2, 5, generator=gen)


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


def gathered_grad(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--compile", action="store_true", help="torch.compile the chunk math")
    args = parser.parse_args()
    out_dir, logprobs.COMPILE = args.out_dir, args.compile
    st = ParallelState.initialize(tp=dist.get_world_size() if dist.is_initialized() else
                                  int(os.environ["WORLD_SIZE"]), device="cpu")
    logits, targets, w_lp = inputs()
    width = PADDED // st.tp
    local = logits[..., st.tp_rank * width:(st.tp_rank + 1) * width].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(local, targets, TEMPERATURE, VOCAB, chunk=CHUNK,
                                      with_entropy=True)
    assert not ent.requires_grad
    (lp * w_lp).sum().backward()
    result = dict(logprobs=lp.tolist(), entropy=ent.tolist(), grad=gathered_grad(local.grad).tolist(),
                  compiled=logprobs._Kernels.compiled not in (None, logprobs.EAGER))
    naive = local.detach().clone().requires_grad_(True)
    (naive_logprobs(naive, targets, st.tp_rank * width) * w_lp).sum().backward()
    result["naive_grad"] = gathered_grad(naive.grad).tolist()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
