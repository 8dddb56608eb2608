"""Worker: LoRA training steps in several parallel layouts, one job after another in one process
group, for tests/distributed/test_lora_tp.py. Writes {out_dir}/rank{R}.json: {job: results}.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/lora_train.py \\
        --out_dir OUT --jobs jobs.json

A job loads the tiny HF checkpoint `hf_dir` through the bridge in layout tp/pp/ep/etp, with
sequence parallelism when `sp` (the other ranks are data parallel), adds adapters (seeded, layout
independent, B set to seeded nonzero values; the job's `modules_to_save` trained in full beside
them) and runs STEPS Adam steps of next-token cross-entropy
on fixed batches through megatron's DDP, optimizer and forward_backward. It records losses and
grad norms, writes the step-0 adapter gradients ({out_dir}/{name}.grads.pt) and the adapters
before and after training ({out_dir}/{name}.init, .final; PEFT format). `save_model_dir` also
writes a megatron distributed checkpoint of the trained model; `load_model_dir` loads one instead
of training and saves the adapters it holds as .final.
"""
import argparse
import json
import os

GLOBAL_BATCH, MICRO_BATCH, SEQ, STEPS = 4, 2, 16, 3


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

    from lora_common import randomize_b
    from swift_megatron.bridge import Bridge
    from swift_megatron.lora import LoraConfig, apply_lora
    from swift_megatron.model.build import build_model
    from swift_megatron.model.config import load_hf_config

    hf_config = load_hf_config(job["hf_dir"])
    model, config, shape = build_model(hf_config, torch.float32, state.device,
                                       sequence_parallel=bool(job.get("sp")))
    bridge = Bridge(hf_config, shape, config)
    bridge.load(model, job["hf_dir"])
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, seed=3,
                      modules_to_save=tuple(job.get("modules_to_save", ())))
    apply_lora(model, lora, bridge.mappings)
    randomize_b(model, seed=9)
    return model.train(), shape.vocab_size, lora, bridge


def train(job, state, model, vocab, out_dir):
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from swift_megatron.lora import adapter_state_dict
    from swift_megatron.training.optim import (OptimizerSettings, build_optimizer,
                                               build_scheduler, wrap_ddp)
    from swift_megatron.training.step import (contribution_scale, forward_backward,
                                              optimizer_step, zero_grads)

    ddp = wrap_ddp(model, model.config, False)
    settings = OptimizerSettings(lr=1e-2, weight_decay=0.0, clip_grad=1.0, lr_decay_style="constant",
                                 train_iters=STEPS)
    optimizer = build_optimizer([ddp], model.config, settings)
    scheduler = build_scheduler(optimizer, settings)
    losses, norms = [], []
    for step in range(STEPS):
        micro = batches(step, state, vocab)
        scale = contribution_scale(len(micro), state.dp)

        def loss_fn(mb, output):
            logits = output.logits()
            per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb["labels"])
            contribution = per_token.sum() / (GLOBAL_BATCH * SEQ)
            return contribution * scale, {"loss": contribution.detach()}

        zero_grads([ddp], optimizer)
        outputs = forward_backward([ddp], micro, loss_fn)
        if step == 0:
            grads = adapter_state_dict(model, tensor_of=lambda p: p.main_grad)
            if grads is not None:
                torch.save(grads, os.path.join(out_dir, f"{job['name']}.grads.pt"))
        norms.append(optimizer_step(optimizer, scheduler)[1])
        local = torch.stack([o["loss"] for o in outputs]).sum() if outputs else torch.zeros(())
        dist.all_reduce(local, group=state.dp_group)
        losses.append(local.item() if state.is_last_stage else None)
    return {"losses": losses, "grad_norms": norms}


def run_job(job, out_dir):
    from swift_megatron.checkpoint.dist import load_model, save_model
    from swift_megatron.lora import save_adapter
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(tp=job.get("tp", 1), pp=job.get("pp", 1), ep=job.get("ep", 1),
                                     etp=job.get("etp", 1), device="cpu", seed=0)
    model, vocab, lora, bridge = build(job, state)
    prefix = os.path.join(out_dir, job["name"])
    save_adapter(model, prefix + ".init", job["hf_dir"], lora, bridge)
    result = {}
    if job.get("load_model_dir"):
        load_model([model], job["load_model_dir"])
    else:
        result = train(job, state, model, vocab, out_dir)
    save_adapter(model, prefix + ".final", job["hf_dir"], lora, bridge)
    if job.get("save_model_dir"):
        save_model([model], job["save_model_dir"])
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
    results = {job["name"]: run_job(job, args.out_dir) for job in jobs}
    with open(os.path.join(args.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
