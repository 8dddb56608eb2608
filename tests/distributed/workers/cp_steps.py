"""Worker: 2 Adam steps of the GRPO loss on tiny 4-layer dense and MoE models, on padded and on
packed (THD) micro-batches of completions of very different lengths, in the layout given by
--cp (context parallelism), --pp and --vpp (the interleaved pipeline), in micro-batches of
--micro_batch_size completions; writes each
configuration's step losses (last stage), grad norms, entropy and old-policy logprobs (the
forward-only pass) to {out_dir}/rank{R}.json.

Every layout starts from the same weights: each parameter is filled from a generator seeded by
its global name (the layouts here do not shard parameters: TP = 1), so no checkpoint is needed.
"""
import argparse
import json
import os
import zlib
from functools import partial

import torch
import torch.distributed as dist

from swift_megatron.bridge.position import RankPosition
from swift_megatron.model.build import build_chunks
from swift_megatron.parallel.context import padding_multiples
from swift_megatron.parallel.state import ParallelState
from swift_megatron.rlhf.grpo.batch import fixed_length, split_micro_batches
from swift_megatron.rlhf.grpo.objective import (LossSettings, StepConstants, collect_logprobs,
                                                grpo_loss)
from swift_megatron.training.optim import (OptimizerSettings, build_optimizer, build_scheduler,
                                           wrap_ddp)
from swift_megatron.training.step import (contribution_scale, forward_backward, optimizer_step,
                                          zero_grads)
from tests.distributed.workers.packed_vs_padded import DENSE, MOE, samples


def fill_weights(chunk, num_layers: int) -> None:
    """Weights from the parameter's global name only: the same in every layout (TP = 1; the
    models' embeddings are untied, else the last stage's output layer would get a fill of its
    own)."""
    pos = RankPosition.current(num_layers).for_chunk(chunk)
    for name, param in chunk.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(pos.to_global(name).encode()))
        noise = torch.randn(param.shape, generator=gen)
        with torch.no_grad():
            param.copy_(1.0 + 0.1 * noise if param.dim() == 1 else 0.08 * noise)


def run(hf, packed: bool, st: ParallelState, micro_batch_size: int):
    chunks, cfg, shape = build_chunks(hf, torch.float32, st.device)
    for chunk in chunks:
        fill_weights(chunk, hf["num_hidden_layers"])
    ddp = [wrap_ddp(chunk, cfg, False) for chunk in chunks]
    settings = LossSettings(loss_type="grpo", beta=0.5, epsilon=0.2, epsilon_high=0.28,
                            delta=None, importance_sampling_level="token", temperature=0.9,
                            max_completion_length=32, vocab_size=shape.vocab_size)
    optim = OptimizerSettings(lr=1e-3, weight_decay=0.0, clip_grad=1.0, train_iters=2)
    optimizer = build_optimizer(ddp, cfg, optim)
    scheduler = build_scheduler(optimizer, optim)
    completions = samples()
    for i, sample in enumerate(completions):  # advantages that do not sum to zero
        sample.advantage = 0.4 * i - 0.7
    # every layout reads the same rows: CP=2's padding and the interleaved pipeline's one shape
    row, seq = padding_multiples(1, 2)
    length = fixed_length(completions, micro_batch_size, packed, row, seq)
    micro = split_micro_batches(completions, micro_batch_size, pad_id=0, pad_to_multiple=row,
                                sequence_multiple=seq, packed=packed, length=length)
    constants = StepConstants(num_sequences=6, num_micro_batches=len(micro),
                              num_tokens=float(sum(mb["completion_mask"].sum() for mb in micro)),
                              contribution_scale=contribution_scale(len(micro), st.dp))
    result = dict(losses=[], grad_norms=[], entropy=[], logprobs=[])
    for _ in range(2):
        with torch.no_grad():
            old = forward_backward(ddp, micro, partial(collect_logprobs, settings), True)
        result["logprobs"].append([(o["logprobs"] * mb["completion_mask"]).tolist()
                                   for o, mb in zip(old, micro)])
        for o, mb in zip(old, micro):  # the reference: the first step's policy
            mb.setdefault("ref_logprobs", o["logprobs"])
        zero_grads(ddp, optimizer)
        outputs = forward_backward(ddp, micro, partial(grpo_loss, settings, constants))
        _, norm = optimizer_step(optimizer, scheduler)
        result["grad_norms"].append(norm)
        result["losses"].append(sum(float(o["loss"]) for o in outputs) if outputs else None)
        result["entropy"].append([float(o["entropy"]) for o in outputs])
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--micro_batch_size", type=int, default=3)
    a = parser.parse_args()
    st = ParallelState.initialize(cp=a.cp, pp=a.pp, vpp=a.vpp, device="cpu", seed=5)
    results = {f"{name}_{layout}": run(dict(hf, num_hidden_layers=4), layout == "packed", st,
                                                   a.micro_batch_size)
               for name, hf in (("dense", DENSE), ("moe", MOE))
               for layout in ("padded", "packed")}
    with open(os.path.join(a.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
