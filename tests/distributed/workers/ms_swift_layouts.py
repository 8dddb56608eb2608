"""Worker: write tiny models as ms-swift Megatron checkpoints (ms_swift_format.py) in one layout
and load them through swift_megatron.checkpoint.ms_swift in others. Writes {out_dir}/rank{R}.json:
{job name: results}.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/ms_swift_layouts.py \\
        --out_dir OUT --jobs jobs.json

jobs.json is a list of jobs, run in order in one process group (the model-parallel groups are
re-created per job):
    name            result key
    hf_dir          the tiny HF checkpoint
    write           write it there as an ms-swift checkpoint (float32 unless `dtype`; layers
                    stored one by one with `per_layer`)
    load            load this ms-swift checkpoint into our GPTModel, export it back (compared
                    with hf_dir bit for bit) and measure its logits against transformers
    lora_load       the same into a model with fresh LoRA adapters (export only)
    write_lora      write the PEFT adapter `peft_dir` (q/k/v and gate/up sharing A) there as
                    an ms-swift LoRA checkpoint (adapter tensors only)
    tp, ep, etp     parallel degrees (default 1)

torch and megatron are imported inside the functions: megatron's checkpoint writer starts a
"spawn" helper process that re-imports this script, and a light script keeps that start fast.
"""
import argparse
import dataclasses
import json
import os

from bridge_layouts import compare_export
from ms_swift_format import (build_ms_swift_model, write_ms_swift_checkpoint,
                             write_ms_swift_lora_checkpoint)


def write_job(job: dict, state) -> dict:
    import torch

    dtype = job.get("dtype", "float32")
    model, _ = build_ms_swift_model(job["hf_dir"], getattr(torch, dtype), state.tp)
    write_ms_swift_checkpoint(model, job["hf_dir"], job["write"], state, dtype_name=dtype,
                              per_layer=job.get("per_layer", False))
    return {"written": job["write"]}


def load_job(job: dict, state) -> dict:
    import torch

    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.export import measure_precision
    from swift_megatron.model.config import load_hf_config

    hf_config = load_hf_config(job["hf_dir"])
    loaded = load_mcore_model(hf_config, hf_config["model_type"], torch.float32, state,
                              mcore_dir=job["load"])
    return {"export": compare_export(loaded, job["hf_dir"]),
            "precision": dataclasses.asdict(measure_precision(loaded, job["hf_dir"], state))}


def lora_load_job(job: dict, state) -> dict:
    """Base weights into a model that already carries (fresh, B = 0) adapters, as a LoRA run
    would load them: the export (W + scale * B A) then gives the original tensors."""
    import torch

    from swift_megatron.bridge import Bridge
    from swift_megatron.checkpoint.ms_swift import load_ms_swift_model
    from swift_megatron.checkpoint.loaded_model import LoadedModel
    from swift_megatron.lora import LoraConfig, apply_lora
    from swift_megatron.model.build import build_model
    from swift_megatron.model.config import load_hf_config

    hf_config = load_hf_config(job["hf_dir"])
    model, config, shape = build_model(hf_config, torch.float32, state.device, random_init=False)
    bridge = Bridge(hf_config, shape, config)
    apply_lora(model, LoraConfig(), bridge.mappings)
    load_ms_swift_model([model], job["lora_load"], bridge)
    return {"export": compare_export(LoadedModel(model, bridge, shape, torch.float32),
                                     job["hf_dir"])}


def run_job(job: dict) -> dict:
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(tp=job.get("tp", 1), ep=job.get("ep", 1),
                                     etp=job.get("etp", 1), device="cpu", seed=0)
    if "write" in job:
        return write_job(job, state)
    if "write_lora" in job:
        write_ms_swift_lora_checkpoint(job["peft_dir"], job["hf_dir"], job["write_lora"], state)
        return {"written": job["write_lora"]}
    return lora_load_job(job, state) if "lora_load" in job else load_job(job, state)


def main():
    import torch.distributed as dist

    from swift_megatron.parallel.state import ParallelState

    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--jobs", required=True)
    args = parser.parse_args()
    with open(args.jobs) as f:
        jobs = json.load(f)
    results = {job["name"]: run_job(job) for job in jobs}
    with open(os.path.join(args.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
