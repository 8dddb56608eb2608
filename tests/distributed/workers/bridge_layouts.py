"""Worker: load tiny HF checkpoints into Megatron in several parallel layouts, export each back and
compare every tensor with the original safetensors bit for bit; optionally save the forward
logits, measure them against transformers, and write a Megatron model directory or an HF
checkpoint. Writes {out_dir}/rank{R}.json: {job name: results}.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/bridge_layouts.py \\
        --out_dir OUT --jobs jobs.json

jobs.json is a list of jobs, run in order in one process group (the model-parallel groups are
re-created per job):
    name            result key; logits go to {out_dir}/{name}.logits.pt (rank 0)
    hf_dir          the original HF checkpoint (exports are compared with it)
    load            "hf" (through the bridge) or a Megatron model directory (any layout)
    tp, pp, ep, etp parallel degrees (default 1); sp: sequence parallelism (default false)
    first, last     layers of the first / last pipeline stage (an uneven split)
    logits          save the float32 logits on fixed random tokens
    precision       compare the logits with transformers (swift_megatron.export.measure_precision)
    long_precision  the same on sequences of this many tokens
    save_model_dir  write a Megatron model directory there
    save_hf         write an HF checkpoint there, with max_shard_size (default 5GB)

torch and megatron are imported inside the functions: megatron's checkpoint writer starts a
"spawn" helper process that re-imports this script, and a light script keeps that start fast.
"""
import argparse
import dataclasses
import json
import os


def compare_export(loaded, hf_dir: str) -> dict:
    """Drain the bridge's export and compare each tensor with the original checkpoint (whose
    tensors outside the Megatron model, the family's passthrough, are not expected)."""
    import torch

    from swift_megatron.bridge.io import HFReader

    reader = HFReader(hf_dir)
    names, mismatched = [], []
    for name, tensor in loaded.bridge.export(loaded.model):
        names.append(name)
        original = reader.read(name) if name in reader else None
        same = original is not None and original.dtype == tensor.dtype
        if not (same and torch.equal(original, tensor.cpu())):
            mismatched.append(name)
    passthrough = {n for n in reader.file_of if n.startswith(tuple(loaded.bridge.passthrough))}
    return {"exported": len(names), "duplicates": len(names) - len(set(names)),
            "missing": sorted(set(reader.file_of) - set(names) - passthrough),
            "mismatched": mismatched, "passthrough": len(passthrough)}


def run_job(job: dict, out_dir: str) -> dict:
    import torch

    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.export import mcore_logits, measure_precision, random_tokens, save_model_dir
    from swift_megatron.model.config import load_hf_config, model_shape
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(tp=job.get("tp", 1), pp=job.get("pp", 1), ep=job.get("ep", 1),
                                     etp=job.get("etp", 1), device="cpu", seed=0,
                                     first_stage_layers=job.get("first"),
                                     last_stage_layers=job.get("last"))
    hf_config = load_hf_config(job["hf_dir"])
    model_type = model_shape(hf_config).model_type
    source = {"hf_dir": job["hf_dir"]} if job["load"] == "hf" else {"mcore_dir": job["load"]}
    loaded = load_mcore_model(hf_config, model_type, torch.float32, state,
                              sequence_parallel=job.get("sp", False), **source)
    result = {"export": compare_export(loaded, job["hf_dir"]),
              "layers": len(loaded.model.decoder.layers)}
    if job.get("logits"):
        tokens = random_tokens(loaded.shape.vocab_size, loaded.shape.max_position_embeddings, "cpu")
        logits = mcore_logits(loaded, tokens, state)
        if state.rank == 0:
            torch.save(logits, os.path.join(out_dir, f"{job['name']}.logits.pt"))
    if job.get("precision"):
        result["precision"] = dataclasses.asdict(measure_precision(loaded, job["hf_dir"], state))
    if job.get("long_precision"):
        result["long_precision"] = dataclasses.asdict(measure_precision(
            loaded, job["hf_dir"], state, length=job["long_precision"]))
    if job.get("save_model_dir"):
        save_model_dir(loaded, job["save_model_dir"], job["hf_dir"], state)
    if job.get("save_hf"):
        loaded.bridge.save_hf(loaded.model, job["save_hf"], source_dir=job["hf_dir"],
                              max_shard_size=job.get("max_shard_size", "5GB"), exist_ok=True)
    return result


def main():
    import torch.distributed as dist

    from swift_megatron.parallel.state import ParallelState

    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--jobs", required=True)
    args = parser.parse_args()
    with open(args.jobs) as f:
        jobs = json.load(f)
    results = {job["name"]: run_job(job, args.out_dir) for job in jobs}
    with open(os.path.join(args.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
