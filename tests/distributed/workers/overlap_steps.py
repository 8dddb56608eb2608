"""Worker: Adam steps of a logprob loss (the GRPO head: model/logprobs.py) on a tiny Qwen3-shaped
model over DP ranks, full or LoRA training, with and without megatron's overlapped gradient
reduction and parameter all-gather (--overlap_grad_reduce / --overlap_param_gather), one job
after another in one process group. Writes {out_dir}/rank{R}.json: {job: {losses, grad_norms,
weights}}, `weights` the sum and sum of squares of every trained parameter after the steps.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/overlap_steps.py \\
        --out_dir OUT --jobs jobs.json

A job: name, lora (bool), dist_opt (bool), overlap_grad_reduce, overlap_param_gather (bools),
bucket_size (elements per DDP bucket; small values make several buckets). The model's weights
come from the same seed in every job, so the jobs differ only by the options.
"""
import argparse
import json
import os

HF = dict(model_type="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
          tie_word_embeddings=False)   # the output layer has a weight (and a gradient) of its own
GLOBAL_BATCH, MICRO_BATCH, SEQ, STEPS = 8, 2, 16, 3


def batches(step, state):
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, HF["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per_dp = GLOBAL_BATCH // state.dp
    mine = tokens[state.dp_rank * per_dp:(state.dp_rank + 1) * per_dp]
    return [dict(tokens=mine[i:i + MICRO_BATCH, :-1], labels=mine[i:i + MICRO_BATCH, 1:],
                 position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ))
            for i in range(0, per_dp, MICRO_BATCH)]


def build(job, state):
    import torch

    from swift_megatron.bridge import Bridge
    from swift_megatron.lora import LoraConfig, apply_lora
    from swift_megatron.model.build import build_model

    model, config, shape = build_model(HF, torch.float32, state.device)
    if job.get("lora"):
        from lora_common import randomize_b

        apply_lora(model, LoraConfig(r=4, lora_alpha=8, seed=3), Bridge(HF, shape, config).mappings)
        randomize_b(model, seed=9)
    return model.train(), config


def train(job, state):
    import torch
    import torch.distributed as dist

    from swift_megatron.training.optim import (OptimizerSettings, build_optimizer,
                                               build_scheduler, overlap_sync_funcs, wrap_ddp)
    from swift_megatron.training.step import (contribution_scale, forward_backward,
                                              gather_params, optimizer_step, zero_grads)

    model, config = build(job, state)
    ddp = wrap_ddp(model, config, job.get("dist_opt", False),
                   overlap_grad_reduce=job.get("overlap_grad_reduce", False),
                   overlap_param_gather=job.get("overlap_param_gather", False),
                   bucket_size=job.get("bucket_size"))
    overlap_sync_funcs(config, [ddp])
    settings = OptimizerSettings(lr=1e-2, weight_decay=0.01, clip_grad=1.0, train_iters=STEPS,
                                 use_distributed_optimizer=job.get("dist_opt", False),
                                 overlap_param_gather=job.get("overlap_param_gather", False))
    optimizer = build_optimizer([ddp], config, settings)
    scheduler = build_scheduler(optimizer, settings)
    losses, norms = [], []
    for step in range(STEPS):
        micro = batches(step, state)
        scale = contribution_scale(len(micro), state.dp)

        def loss_fn(mb, output):
            contribution = -output.logprobs(mb["labels"], 1.0, HF["vocab_size"]).sum() / (
                GLOBAL_BATCH * SEQ)
            return contribution * scale, {"loss": contribution.detach()}

        zero_grads([ddp], optimizer)
        outputs = forward_backward([ddp], micro, loss_fn)
        norms.append(optimizer_step(optimizer, scheduler)[1])
        local = torch.stack([o["loss"] for o in outputs]).sum()
        dist.all_reduce(local, group=state.dp_group)
        losses.append(local.item())
    gather_params([ddp])
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = [sum(float(p.double().sum()) for p in trained),
               sum(float(p.double().square().sum()) for p in trained)]
    return {"losses": losses, "grad_norms": norms, "weights": weights,
            "buckets": len(ddp.bucket_groups)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--jobs")
    args = parser.parse_args()
    import torch.distributed as dist

    from swift_megatron.parallel.state import ParallelState

    with open(args.jobs) as f:
        jobs = json.load(f)
    results = {}
    for job in jobs:
        state = ParallelState.initialize(device="cpu", seed=1234)
        results[job["name"]] = train(job, state)
    with open(os.path.join(args.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
