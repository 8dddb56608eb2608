"""How fast the bridge streams a Megatron model's weights out as HF tensors (what every weight
sync to vLLM consumes), per tensor-parallel size: run under torchrun with TP = the world size.
Feeds docs/gpu.md, "Weight sync and the vLLM engine" (device_run.sh's export_speed).

Builds a random Megatron model of a preset shape on each rank, then times consuming
`Bridge.export` (the TP all-gathers and HF layout transforms, no engine) --repeats times and
prints one JSON line from rank 0: seconds, bytes exported, GB/s, and the number of tensors.

    python benchmarks/export_speed.py --preset qwen2.5-1.5b
    torchrun --nproc_per_node 2 benchmarks/export_speed.py --preset qwen2.5-1.5b
    python benchmarks/export_speed.py --preset tiny --device cpu
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from grpo_step import PRESETS  # noqa: E402  (the same random-model shapes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    import torch
    import torch.distributed as dist

    from swift_megatron.bridge import Bridge
    from swift_megatron.model.build import build_model
    from swift_megatron.parallel.state import ParallelState

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    state = ParallelState.initialize(tp=tp, device=a.device)
    from transformers import AutoConfig

    values = dict(PRESETS[a.preset])
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values).to_dict()
    dtype = torch.bfloat16 if state.device.type == "cuda" else torch.float32
    model, config, shape = build_model(hf_config, dtype, state.device,
                                       model_type=hf_config["model_type"])
    model.eval()
    bridge = Bridge(hf_config, shape, config)
    seconds = []
    for _ in range(a.repeats + 1):   # the first pass builds the export plan: not counted
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        count = nbytes = 0
        for _, tensor in bridge.export(model):
            count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    best = min(seconds[1:])
    if state.rank == 0:
        print(json.dumps({"name": "export_speed", "preset": a.preset, "tp": tp,
                          "seconds_best": round(best, 4),
                          "seconds_mean": round(statistics.mean(seconds[1:]), 4),
                          "gb": round(nbytes / 1e9, 3), "gb_per_s": round(nbytes / 1e9 / best, 2),
                          "tensors": count}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
