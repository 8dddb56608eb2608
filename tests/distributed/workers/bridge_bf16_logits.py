"""Worker: a random-init HF checkpoint of a real shape, loaded into Megatron with TP (and optional
EP), and its logits compared with transformers' on the same device, in float32 and in bf16
(GPU test of the bridge: tests/gpu/test_bridge_gpu.py; with --device cpu --preset tiny_* it
runs in CPU CI).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/bridge_bf16_logits.py \\
        --out_dir OUT --preset qwen3_1.7b --device cuda --tp 2

Rank 0 writes the random bf16 checkpoint to --hf_dir (default {out_dir}/hf) unless it exists,
every rank loads its shard (in float32, then in bf16), rank 0 runs transformers in both dtypes.
The report (one JSON line, and {out_dir}/rank{R}.json) holds four comparisons:
    float32                      Megatron vs transformers, both float32: the bridge's exactness
    bfloat16                     Megatron vs transformers, both bf16
    mcore_bf16_vs_float32        Megatron bf16 vs the float32 reference
    hf_bf16_vs_float32           transformers bf16 vs the float32 reference
A random model's logits are nearly uniform, so bf16 rounding alone flips many argmaxes between
any two bf16 implementations; Megatron's bf16 error is therefore judged against transformers'
own bf16 error, both measured from the float32 reference.
Presets: qwen3_1.7b (the real Qwen3-1.7B config.json values), qwen3_moe (a Qwen3-MoE shape for
two GPUs), tiny_qwen3 / tiny_qwen3_moe (the fixtures' tiny models).
"""
import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

# The float32 comparison in true float32 on CUDA: flash-linear-attention's Triton kernels (Qwen3.5's
# Gated DeltaNet) otherwise multiply float32 in TF32, whose rounding flips near-tied routes of a
# random MoE router, and a flip then spreads down the sequence through the recurrence (H200:
# mean |diff| 4.4e-3 for the Qwen3.5-MoE shape, 1.4e-4 dense). Read when Triton compiles.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from swift_megatron.checkpoint.loaded_model import load_mcore_model
from swift_megatron.export import compare_logits, hf_logits, mcore_logits, random_tokens
from swift_megatron.fixtures import build_tiny_model
from swift_megatron.fixtures.shapes import REAL_SHAPES
from swift_megatron.model.config import load_hf_config
from swift_megatron.model.text_config import text_config
from swift_megatron.parallel.state import ParallelState

PRESETS = {"qwen3_1.7b": REAL_SHAPES["qwen3-1.7b"], "qwen3_moe": REAL_SHAPES["qwen3-moe-small"],
           "qwen3_5": REAL_SHAPES["qwen3.5-9b-4l"], "qwen3_5_moe": REAL_SHAPES["qwen3.5-moe-small"]}
TINY = {"tiny_qwen3": "qwen3", "tiny_qwen3_moe": "qwen3_moe"}


def write_random_model(preset: str, out_dir: str, dtype: torch.dtype, device: torch.device) -> None:
    """A random-init checkpoint of the preset's shape (initialised on `device`, for speed)."""
    if preset in TINY:
        build_tiny_model(TINY[preset], out_dir, dtype=str(dtype).removeprefix("torch."))
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(PRESETS[preset])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir)
    del model


def megatron_logits(hf_dir: str, dtype: torch.dtype, state, tokens) -> torch.Tensor:
    hf_config = load_hf_config(hf_dir)
    loaded = load_mcore_model(hf_config, text_config(hf_config)["model_type"], dtype, state,
                              hf_dir=hf_dir)
    logits = mcore_logits(loaded, tokens, state)
    del loaded
    if state.device.type == "cuda":
        torch.cuda.empty_cache()
    return logits


def compare_all(hf_dir: str, mcore: dict, tokens) -> dict:
    """The four comparisons of the module docstring (rank 0: runs transformers twice)."""
    hf = {name: hf_logits(hf_dir, tokens, dtype)
          for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    pairs = {"float32": (mcore["float32"], hf["float32"]),
             "bfloat16": (mcore["bfloat16"], hf["bfloat16"]),
             "mcore_bf16_vs_float32": (mcore["bfloat16"], hf["float32"]),
             "hf_bf16_vs_float32": (hf["bfloat16"], hf["float32"])}
    return {name: dataclasses.asdict(compare_logits(a, b, name)) for name, (a, b) in pairs.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--preset", choices=[*PRESETS, *TINY], default="tiny_qwen3")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--hf_dir", help="where the random checkpoint is (or is written)")
    args = parser.parse_args()
    state = ParallelState.initialize(tp=args.tp, ep=args.ep, device=args.device, seed=0)
    hf_dir = args.hf_dir or os.path.join(args.out_dir, "hf")
    start = time.perf_counter()
    if state.rank == 0 and not os.path.isdir(hf_dir):
        write_random_model(args.preset, hf_dir, torch.bfloat16, state.device)
    state.barrier()
    text = text_config(load_hf_config(hf_dir))
    tokens = random_tokens(text["vocab_size"], text["max_position_embeddings"], state.device)
    mcore = {name: megatron_logits(hf_dir, dtype, state, tokens)
             for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    result = dict(name="bridge_logits", preset=args.preset, device=args.device, tp=args.tp,
                  ep=args.ep, **(compare_all(hf_dir, mcore, tokens) if state.rank == 0 else {}))
    result["seconds"] = round(time.perf_counter() - start, 1)
    if state.rank == 0:
        print(json.dumps(result), flush=True)
    with open(os.path.join(args.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
