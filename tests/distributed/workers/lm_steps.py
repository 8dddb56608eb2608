"""Worker: 3 Adam steps of next-token cross-entropy on a tiny Qwen3-shaped model, in the
parallel layout given by the flags (--first / --last: an uneven pipeline split); writes losses and grad norms to {out_dir}/rank{R}.json.

With --save_init it saves its (seeded random) initial weights first, so that every other layout
can start from exactly the same weights with --init.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from swift_megatron.checkpoint.dist import load_model, save_model
from swift_megatron.model.build import build_model
from swift_megatron.parallel.state import ParallelState
from swift_megatron.training.optim import OptimizerSettings, build_optimizer, build_scheduler, wrap_ddp
from swift_megatron.training.step import contribution_scale, forward_backward, optimizer_step, zero_grads

HF = dict(model_type="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128,
          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
          tie_word_embeddings=True)
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 16


def batch_for(step: int, st: ParallelState):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, HF["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per_dp = GLOBAL_BATCH // st.dp
    mine = tokens[st.dp_rank * per_dp:(st.dp_rank + 1) * per_dp]
    return [dict(tokens=mine[i:i + MICRO_BATCH, :-1], labels=mine[i:i + MICRO_BATCH, 1:],
                 position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ))
            for i in range(0, per_dp, MICRO_BATCH)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dist_opt", type=int, default=0)
    parser.add_argument("--sp", type=int, default=0)
    parser.add_argument("--first", type=int, help="layers of the first pipeline stage")
    parser.add_argument("--last", type=int, help="layers of the last pipeline stage")
    parser.add_argument("--init")
    parser.add_argument("--save_init", type=int, default=0)
    a = parser.parse_args()
    st = ParallelState.initialize(tp=a.tp, pp=a.pp, device="cpu", seed=1234,
                                  first_stage_layers=a.first, last_stage_layers=a.last)
    model, cfg, _ = build_model(HF, torch.float32, st.device, sequence_parallel=bool(a.sp),
                                **st.layer_split)
    if a.save_init:
        save_model([model], a.init)
    else:
        load_model([model], a.init)
    ddp = wrap_ddp(model, cfg, bool(a.dist_opt))
    settings = OptimizerSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                                 use_distributed_optimizer=bool(a.dist_opt), train_iters=3)
    optimizer = build_optimizer([ddp], cfg, settings)
    scheduler = build_scheduler(optimizer, settings)
    total_tokens = GLOBAL_BATCH * SEQ
    losses, norms = [], []
    for step in range(3):
        micro = batch_for(step, st)
        scale = contribution_scale(len(micro), st.dp)

        def loss_fn(mb, output):
            logits = output.logits()
            per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb["labels"])
            contribution = per_token.sum() / total_tokens
            return contribution * scale, {"loss": contribution.detach()}

        zero_grads([ddp], optimizer)
        outputs = forward_backward([ddp], micro, loss_fn)
        _, grad_norm = optimizer_step(optimizer, scheduler)
        local = torch.stack([o["loss"] for o in outputs]).sum() if outputs else torch.zeros(())
        dist.all_reduce(local, group=st.dp_group)
        losses.append(local.item() if st.is_last_stage else None)
        norms.append(grad_norm)
    with open(os.path.join(a.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(dict(losses=losses, grad_norms=norms, layers=len(model.decoder.layers)), f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
