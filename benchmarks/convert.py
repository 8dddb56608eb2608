"""Time `megatron export` conversions against plain safetensors IO on the same disk.
Feeds docs/gpu.md, "Kernels and single-step benchmarks" (device_run.sh's convert).

Writes a random HF checkpoint of a Qwen2-family preset shape (safetensors shards + config.json),
then measures, in one process (TP = PP = 1):

    safetensors_copy   read every tensor with safetensors' load_file, write it back with
                       save_file and fsync it (both conversions write durably, as checkpoints
                       must): the IO floor any conversion pays
    hf_to_mcore        build the Megatron model, load the HF checkpoint through the bridge
                       (.load: the bridge alone; .save: the Megatron model directory write)
    mcore_to_hf        build, load the model directory (.load), Bridge.save_hf (.save)

and prints one JSON line per measurement: {"name", "seconds", "bytes", "ratio_vs_safetensors",
"preset", "device", "dtype"}, then one line saying whether the HF -> Megatron -> HF round trip
gave back every tensor bit for bit.

    python benchmarks/convert.py --preset tiny --device cpu
    python benchmarks/convert.py --preset medium --device cpu
    python benchmarks/convert.py --preset 1.5b --device cuda --dtype bfloat16 --work_dir /data/bench

Presets: tiny (hidden 64, 4 layers, vocab 504), medium (hidden 512, 8 layers, vocab 32000,
~0.1B), 1.5b (Qwen2.5-1.5B: hidden 1536, 28 layers, vocab 151936, ~1.5B).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# torch and megatron are imported inside the functions, as in the `megatron` command: megatron's
# checkpoint writer starts a "spawn" helper process that re-imports the main script, and a heavy
# main script would add its import time (seconds) to every first save.
from swift_megatron.fixtures.shapes import REAL_SHAPES  # noqa: E402  (no torch import)

DTYPE_NAMES = ("bfloat16", "float16", "float32")
_QWEN2 = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
              tie_word_embeddings=True, hidden_act="silu")
PRESETS = {
    "tiny": dict(_QWEN2, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=504),
    "medium": dict(_QWEN2, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, intermediate_size=1536, vocab_size=32000),
    "1.5b": REAL_SHAPES["qwen2.5-1.5b"],
}


def write_random_checkpoint(preset: str, dtype_name: str, out_dir: str) -> int:
    """A random Qwen2 checkpoint of the preset's shape; returns its weight bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from swift_megatron.bridge.io import HFWriter
    from swift_megatron.model.config import DTYPES

    values = {k: v for k, v in PRESETS[preset].items() if k != "model_type"}
    config = AutoConfig.for_model("qwen2", dtype=dtype_name, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: param.shape for name, param in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    os.makedirs(out_dir)
    writer = HFWriter(out_dir, max_shard_size="2GB")
    for name, shape in shapes.items():
        writer.add(name, (torch.randn(shape, generator=generator) * 0.02).to(DTYPES[dtype_name]))
    writer.close()
    config.save_pretrained(out_dir)
    return writer.total_bytes


@contextmanager
def timer(results: dict, name: str, device: str):
    start = time.perf_counter()
    yield
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    results[name] = time.perf_counter() - start


def safetensors_copy(src: str, dst: str) -> None:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            out = os.path.join(dst, name)
            save_file(load_file(os.path.join(src, name)), out)
            with open(out, "rb") as f:
                os.fsync(f.fileno())


def convert_both_ways(hf_dir: str, work: str, dtype_name: str, state) -> dict:
    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.export import save_model_dir
    from swift_megatron.model.config import DTYPES, load_hf_config

    times, dtype, device = {}, DTYPES[dtype_name], state.device.type
    hf_config = load_hf_config(hf_dir)
    with timer(times, "hf_to_mcore.load", device):
        loaded = load_mcore_model(hf_config, "qwen2", dtype, state, hf_dir=hf_dir)
    with timer(times, "hf_to_mcore.save", device):
        save_model_dir(loaded, os.path.join(work, "mcore"), hf_dir, state)
    del loaded
    with timer(times, "mcore_to_hf.load", device):
        loaded = load_mcore_model(hf_config, "qwen2", dtype, state,
                                  mcore_dir=os.path.join(work, "mcore"))
    with timer(times, "mcore_to_hf.save", device):
        loaded.bridge.save_hf(loaded.model, os.path.join(work, "hf_out"), source_dir=hf_dir)
    for direction in ("hf_to_mcore", "mcore_to_hf"):
        times[direction] = times[f"{direction}.load"] + times[f"{direction}.save"]
    return times


def round_trip_exact(hf_dir: str, out_dir: str) -> bool:
    import torch
    from safetensors.torch import load_file

    def tensors(directory):
        found = {}
        for name in os.listdir(directory):
            if name.endswith(".safetensors"):
                found.update(load_file(os.path.join(directory, name)))
        return found

    original, exported = tensors(hf_dir), tensors(out_dir)
    return sorted(original) == sorted(exported) and all(
        torch.equal(original[n], exported[n]) for n in original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    parser.add_argument("--work_dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    from swift_megatron.parallel.state import ParallelState

    work = tempfile.mkdtemp(prefix="convert-bench-", dir=args.work_dir)
    try:
        state = ParallelState.initialize(device=args.device, seed=0)
        hf_dir = os.path.join(work, "hf")
        total = write_random_checkpoint(args.preset, args.dtype, hf_dir)
        times = {}
        with timer(times, "safetensors_copy", "cpu"):
            safetensors_copy(hf_dir, os.path.join(work, "copy"))
        times.update(convert_both_ways(hf_dir, work, args.dtype, state))
        for name, seconds in times.items():
            print(json.dumps({"name": name, "seconds": round(seconds, 3), "bytes": total,
                              "ratio_vs_safetensors": round(seconds / times["safetensors_copy"], 2),
                              "preset": args.preset, "device": args.device, "dtype": args.dtype}))
        print(json.dumps({"name": "round_trip_bit_exact",
                          "ok": round_trip_exact(hf_dir, os.path.join(work, "hf_out"))}))
        ParallelState.destroy()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
