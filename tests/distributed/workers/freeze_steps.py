"""Worker: full training with ms-swift's freeze flags (training/freeze.py) in several parallel
layouts, one job after another in one process group, for tests/distributed/test_freeze.py.
Writes {out_dir}/rank{R}.json: {job: results}.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/freeze_steps.py \\
        --out_dir OUT --jobs jobs.json

A job loads a tiny HF checkpoint through the bridge in layout tp/pp/ep (the other ranks data
parallel), applies the job's flags with `apply_freeze` (what `megatron rlhf` does before DDP
wrapping), then runs STEPS Adam steps of next-token cross-entropy through megatron's DDP,
optimizer (distributed with `dist_opt`) and forward_backward, and records per rank: the global
names it froze, whether every frozen parameter is bit-identical afterwards and every trainable
one moved, whether a frozen parameter got a gradient buffer, and the optimizer state's elements
against the trainable ones.
"""
import argparse
import json
import os

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 2, 4, 2, 16


def batches(step, state, vocab):
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per_dp = GLOBAL_BATCH // state.dp
    mine = tokens[state.dp_rank * per_dp:(state.dp_rank + 1) * per_dp]
    return [dict(tokens=mine[i:i + MICRO_BATCH, :-1], labels=mine[i:i + MICRO_BATCH, 1:],
                 position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ))
            for i in range(0, per_dp, MICRO_BATCH)]


def build(job, state):
    import torch

    from swift_megatron.arguments.freeze import FreezeArguments
    from swift_megatron.bridge import Bridge
    from swift_megatron.model.build import build_model
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.model.trainable import FreezeRules
    from swift_megatron.training.freeze import apply_freeze

    hf_config = load_hf_config(job["hf_dir"])
    model, config, shape = build_model(hf_config, torch.float32, state.device)
    Bridge(hf_config, shape, config).load(model, job["hf_dir"])
    apply_freeze([model], FreezeRules.from_arguments(FreezeArguments(**job["flags"])))
    return model.train(), shape.vocab_size


def optimizer_elements(optimizer) -> int:
    from swift_megatron.training.optim import torch_optimizers

    return sum(state["exp_avg"].numel() for inner in torch_optimizers(optimizer)
               for state in inner.state.values())


def train(job, state, model, vocab):
    import torch
    from megatron.core import tensor_parallel

    from swift_megatron.training.optim import (OptimizerSettings, build_optimizer,
                                               build_scheduler, wrap_ddp)
    from swift_megatron.training.step import (contribution_scale, forward_backward,
                                              optimizer_step, zero_grads)

    dist_opt = bool(job.get("dist_opt"))
    ddp = wrap_ddp(model, model.config, dist_opt)
    settings = OptimizerSettings(lr=1e-2, weight_decay=0.1, clip_grad=1.0, train_iters=STEPS,
                                 lr_decay_style="constant", use_distributed_optimizer=dist_opt)
    optimizer = build_optimizer([ddp], model.config, settings)
    scheduler = build_scheduler(optimizer, settings)
    norms = []
    for step in range(STEPS):
        micro = batches(step, state, vocab)
        scale = contribution_scale(len(micro), state.dp)

        def loss_fn(mb, output):
            logits = output.logits()
            per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb["labels"])
            contribution = per_token.sum() / (GLOBAL_BATCH * SEQ)
            return contribution * scale, {"loss": contribution.detach()}

        zero_grads([ddp], optimizer)
        forward_backward([ddp], micro, loss_fn)
        norms.append(optimizer_step(optimizer, scheduler)[1])
    return optimizer, norms


def run_job(job):
    from swift_megatron.parallel.state import ParallelState
    from swift_megatron.training.freeze import local_parameters

    state = ParallelState.initialize(tp=job.get("tp", 1), pp=job.get("pp", 1),
                                     ep=job.get("ep", 1), device="cpu", seed=0)
    model, vocab = build(job, state)
    params = local_parameters([model])
    before = {name: param.detach().clone() for name, param, _ in params}
    optimizer, norms = train(job, state, model, vocab)
    frozen = [(n, p) for n, p, _ in params if not p.requires_grad]
    trains = [(n, p) for n, p, _ in params if p.requires_grad]
    result = {
        "frozen": sorted(n for n, _ in frozen),
        "frozen_identical": all(bool((p.detach() == before[n]).all()) for n, p in frozen),
        "trainable_moved": all(bool((p.detach() != before[n]).any()) for n, p in trains),
        "frozen_with_grad_buffer": sorted(n for n, p in frozen
                                          if getattr(p, "main_grad", None) is not None),
        "optimizer_elements": optimizer_elements(optimizer),
        "trainable_elements": sum(p.numel() for _, p in trains),
        "dp": state.dp, "grad_norms": norms}
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--jobs")
    args = parser.parse_args()
    import torch.distributed as dist

    from swift_megatron.parallel.state import ParallelState

    with open(args.jobs) as f:
        jobs = json.load(f)
    results = {job["name"]: run_job(job) for job in jobs}
    with open(os.path.join(args.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
