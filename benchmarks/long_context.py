"""Train-step time and peak memory on one long sequence, with and without context parallelism:
one packed micro-batch holding a 256-token prompt and a completion up to --seq tokens, the GRPO
loss (the trainer's loss and logprob path, CP-aware), an Adam step, on the random model of a
preset, bf16 on CUDA.
Feeds docs/gpu.md, "Long sequences and context parallelism" (device_run.sh's long_context,
long_recompute).

    python benchmarks/long_context.py --preset qwen2.5-1.5b --seq 16384
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/long_context.py \
        --preset qwen2.5-1.5b --seq 32768 --cp 2 --recompute full

One JSON line from rank 0: seconds per step (mean of --steps after one warm-up step), tokens per
second and peak memory allocated (GiB), or the out-of-memory error when the sequence does not fit.
"""
import argparse
import json
import os
import sys
import time
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from lora_step import PRESETS  # noqa: E402  (the same random-model shapes, "small" included)

PROMPT = 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS))
    parser.add_argument("--seq", type=int, default=16384, help="prompt + completion tokens")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (= processes)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                        help="activation recomputation, as --recompute_granularity (full: "
                             "uniform, one layer per checkpoint)")
    a = parser.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from swift_megatron.model.build import build_chunks
    from swift_megatron.parallel.context import padding_multiples
    from swift_megatron.parallel.state import ParallelState
    from swift_megatron.rlhf.grpo.batch import Sample, fixed_length, split_micro_batches, to_device
    from swift_megatron.rlhf.grpo.objective import LossSettings, StepConstants, grpo_loss
    from swift_megatron.training.optim import (OptimizerSettings, build_optimizer,
                                               build_scheduler, wrap_ddp)
    from swift_megatron.training.step import (contribution_scale, forward_backward,
                                              optimizer_step, zero_grads)

    st = ParallelState.initialize(cp=a.cp, device=a.device, seed=0)
    values = dict(PRESETS[a.preset])
    hf = AutoConfig.for_model(values.pop("model_type"), **values).to_dict()
    hf["max_position_embeddings"] = max(hf.get("max_position_embeddings", 0), a.seq)
    dtype = torch.bfloat16 if st.device.type == "cuda" else torch.float32
    recompute = {} if a.recompute == "none" else dict(recompute_granularity=a.recompute)
    if a.recompute == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    chunks, config, shape = build_chunks(hf, dtype, st.device, **recompute)
    ddp = [wrap_ddp(chunk.train(), config, False) for chunk in chunks]
    optim = OptimizerSettings(lr=1e-6, clip_grad=1.0, lr_decay_style="constant",
                              train_iters=a.steps + 1)
    optimizer = build_optimizer(ddp, config, optim)
    scheduler = build_scheduler(optimizer, optim)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, shape.vocab_size, (a.seq + 1,), generator=gen).tolist()
    sample = Sample(group_id=0, prompt_id=0, prompt_ids=ids[:PROMPT], completion_ids=ids[PROMPT:],
                    rollout_logprobs=[-1.0] * (len(ids) - PROMPT), finish_reason="length",
                    rewards=[], advantage=1.0)
    row, seq_multiple = padding_multiples(1, a.cp)
    micro = [to_device(mb, st.device) for mb in split_micro_batches(
        [sample], 1, pad_id=0, pad_to_multiple=row, sequence_multiple=seq_multiple, packed=True,
        length=fixed_length([sample], 1, True, row, seq_multiple))]
    settings = LossSettings(loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.2,
                            delta=None, importance_sampling_level="token", temperature=1.0,
                            max_completion_length=a.seq, vocab_size=shape.vocab_size)
    constants = StepConstants(num_sequences=1, num_micro_batches=1,
                              num_tokens=float(micro[0]["completion_mask"].sum()),
                              contribution_scale=contribution_scale(1, st.dp))

    def step():
        zero_grads(ddp, optimizer)
        forward_backward(ddp, micro, partial(grpo_loss, settings, constants))
        optimizer_step(optimizer, scheduler)
        if st.device.type == "cuda":
            torch.cuda.synchronize()

    line = dict(name="long_context", preset=a.preset, seq=a.seq, cp=a.cp, recompute=a.recompute)
    try:
        step()   # warm-up
        seconds = []
        for _ in range(a.steps):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        mean = sum(seconds) / len(seconds)
        line.update(seconds_per_step=round(mean, 4), tokens_per_s=round(a.seq / mean, 1))
    except torch.OutOfMemoryError as exc:
        line.update(error=f"out of memory: {str(exc).splitlines()[0]}")
    if st.device.type == "cuda":
        line["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    if dist.get_rank() == 0:
        print(json.dumps(line), flush=True)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
