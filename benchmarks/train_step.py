"""Forward + backward time of one Megatron-core training micro-batch: our layer spec (SDPA core
attention, model/spec.py) against megatron-core's local spec (unfused DotProductAttention, the
baseline in shared/device/README.md: Qwen3-1.7B shape, seq 4096, micro-batch 1, bf16,
0.364 s/step, ~153 TFLOP/s on an H200).

    python benchmarks/train_step.py --preset qwen3-1.7b --seq 4096      # on a GPU
    python benchmarks/train_step.py --preset tiny --seq 128 --device cpu

Prints one JSON line per spec (seconds per step, tokens/s, model TFLOP/s, peak memory) and
one with the ratio.
"""
import argparse
import json
import time

import torch

from swift_megatron.fixtures.shapes import REAL_SHAPES

PRESETS = {
    # the device notes' baseline: Qwen3-1.7B layers with untied embeddings (2.03B parameters)
    "qwen3-1.7b": dict(REAL_SHAPES["qwen3-1.7b"], tie_word_embeddings=False),
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                 tie_word_embeddings=False),
}


def model_flops(hf: dict, seq: int) -> float:
    """Training FLOPs of one sequence: 6 x matmul params x tokens + causal attention."""
    h, layers, heads, kv, dim = (hf["hidden_size"], hf["num_hidden_layers"],
                                 hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    per_layer = h * dim * (heads + 2 * kv) + heads * dim * h + 3 * h * hf["intermediate_size"]
    params = layers * per_layer + h * hf["vocab_size"]
    attention = layers * 2 * 2 * heads * dim * seq * seq / 2  # QK^T and PV, causal half
    return 6 * params * seq + 3 * attention


def build(hf: dict, spec: str, device: torch.device):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from swift_megatron.model.build import build_gpt
    from swift_megatron.model.config import model_shape, transformer_config

    config = transformer_config(hf, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                use_cpu_initialization=device.type == "cpu")
    shape = model_shape(hf)
    if spec == "ours":
        return build_gpt(config, shape, True, True)
    from megatron.core.models.gpt import GPTModel

    local = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config, local, vocab_size=shape.padded_vocab_size,
                     max_sequence_length=shape.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=shape.rope_theta)
    return model.cuda() if device.type == "cuda" else model


def time_step(model, seq: int, vocab: int, device, steps: int, warmup: int, spec: str) -> float:
    tokens = torch.randint(0, vocab, (1, seq), device=device)
    positions = torch.arange(seq, device=device).unsqueeze(0)
    # ours is causal without a mask (as in training); the local spec needs an explicit one
    mask = None if spec == "ours" else \
        torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(1)
    elapsed = []
    for step in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(tokens, positions, attention_mask=mask, labels=tokens).float().mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            elapsed.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return sorted(elapsed)[len(elapsed) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-1.7b", choices=sorted(PRESETS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--specs", nargs="+", default=["ours", "mcore_local"])
    a = parser.parse_args()
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(device=a.device)
    hf = PRESETS[a.preset]
    results = {}
    for spec in a.specs:
        model = build(hf, spec, state.device)
        if state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = time_step(model, a.seq, hf["vocab_size"], state.device, a.steps, a.warmup, spec)
        peak = torch.cuda.max_memory_allocated() / 2**30 if state.device.type == "cuda" else 0.0
        results[spec] = seconds
        print(json.dumps({"name": f"train_step/{spec}", "preset": a.preset, "seq": a.seq,
                          "seconds": round(seconds, 4), "tokens_per_s": round(a.seq / seconds),
                          "tflops": round(model_flops(hf, a.seq) / seconds / 1e12, 1),
                          "peak_gib": round(peak, 1)}), flush=True)
        del model
        if state.device.type == "cuda":
            torch.cuda.empty_cache()
    if {"ours", "mcore_local"} <= set(results):
        print(json.dumps({"name": "train_step/speedup_vs_mcore_local",
                          "ratio": round(results["mcore_local"] / results["ours"], 3)}))
    ParallelState.destroy()


if __name__ == "__main__":
    main()
