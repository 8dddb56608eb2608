"""Seconds per training step, full-parameter against LoRA, on the same random model and batches:
megatron DDP, optimizer and forward_backward (the GRPO trainer's step path), next-token
cross-entropy on random tokens through the trainer's output head (model/head.py: chunked
logprobs; megatron's logits path made LoRA's frozen output layer run one product per position,
96 ms of GPU time a step on an H200, 2026-11-27). One JSON line per mode and one with the
ratio LoRA / full (issue: a LoRA step should be no slower than a full one). The layers'
elementwise nodes run as the trainer runs them: compiled on CUDA (model/compiled.py;
SWIFT_MEGATRON_COMPILE_LAYERS=0 / 1 sets both modes). `--profile DIR`
writes a torch-profiler table per mode (self time per op, by host time, then on CUDA by GPU time).
Feeds docs/gpu.md, "LoRA against full" (device_run.sh's lora_step, lora_step_8k).

    python benchmarks/lora_step.py --preset qwen2.5-1.5b                  # GPU
    python benchmarks/lora_step.py --preset small --device cpu --steps 3  # CPU
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from grpo_step import PRESETS  # noqa: E402  (the same random-model shapes)

PRESETS = dict(PRESETS, small=dict(model_type="qwen2", vocab_size=4096, hidden_size=512,
                                   intermediate_size=1536, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2))


def run_mode(a, lora: bool, state) -> dict:
    import torch
    from transformers import AutoConfig

    from swift_megatron.bridge import Bridge
    from swift_megatron.lora import LoraConfig, apply_lora
    from swift_megatron.model.build import build_model
    from swift_megatron.training.optim import (OptimizerSettings, build_optimizer,
                                               build_scheduler, wrap_ddp)
    from swift_megatron.training.step import forward_backward, optimizer_step, zero_grads

    values = dict(PRESETS[a.preset])
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values).to_dict()
    dtype = torch.bfloat16 if state.device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model, config, shape = build_model(hf_config, dtype, state.device,
                                       model_type=hf_config["model_type"])
    if lora:
        apply_lora(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=a.lora_dropout, seed=0),
                   Bridge(hf_config, shape, config).mappings)
    ddp = wrap_ddp(model.train(), config, False)
    settings = OptimizerSettings(lr=1e-6, clip_grad=1.0, lr_decay_style="constant",
                                 train_iters=a.steps + 1)
    optimizer = build_optimizer([ddp], config, settings)
    scheduler = build_scheduler(optimizer, settings)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab_size, (a.micro_batches, a.micro_batch, a.seq + 1),
                           generator=gen).to(state.device)
    micro = [dict(tokens=t[:, :-1], labels=t[:, 1:],
                  position_ids=torch.arange(a.seq, device=state.device).expand(a.micro_batch, a.seq))
             for t in tokens]

    def loss_fn(mb, output):   # the GRPO trainer's head: chunked logprobs, no logits held
        loss = -output.logprobs(mb["labels"], 1.0, shape.vocab_size).mean()
        return loss, {"loss": loss.detach()}

    def step():
        zero_grads([ddp], optimizer)
        forward_backward([ddp], micro, loss_fn)
        optimizer_step(optimizer, scheduler)
        if state.device.type == "cuda":
            torch.cuda.synchronize()

    step()   # warm-up
    seconds = []
    for _ in range(a.steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    calls = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if state.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
        os.makedirs(a.profile, exist_ok=True)
        sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"]
                                           if state.device.type == "cuda" else [])
        with open(os.path.join(a.profile, f"{'lora' if lora else 'full'}.txt"), "w") as f:
            for sort in sorts:   # the host's time first: a step at one GPU waits on it
                f.write(f"sorted by {sort}\n")
                f.write(prof.key_averages().table(sort_by=sort, row_limit=30) + "\n")
        calls = sum(event.count for event in prof.key_averages())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"name": "lora_step", "mode": "lora" if lora else "full", "preset": a.preset,
            "seconds_per_step": round(min(seconds), 4), "trainable_params": trainable,
            **({"profiled_operator_calls": calls} if calls else {})}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro_batches", type=int, default=8)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lora_dropout", type=float, default=0.05)
    parser.add_argument("--profile", default=None, help="directory for the profiler tables")
    a = parser.parse_args()
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(device=a.device)
    results = [run_mode(a, lora, state) for lora in (False, True)]
    for line in results:
        print(json.dumps(line), flush=True)
    print(json.dumps({"name": "lora_step/ratio", "preset": a.preset,
                      "lora_over_full": round(results[1]["seconds_per_step"]
                                              / results[0]["seconds_per_step"], 3)}), flush=True)


if __name__ == "__main__":
    main()
