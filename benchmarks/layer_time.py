"""Forward + backward time per token of each decoder layer of a Qwen3.5 model (Gated DeltaNet
against gated attention), next to the same ratio for the two kernels alone: fla's
chunk_gated_delta_rule against the attention kernel our spec calls (torch's
scaled_dot_product_attention, causal, grouped heads).
Feeds docs/gpu.md, "Not yet measured on the current code" until its first GPU run (device_run.sh's
layer_time).

Each layer runs on its own, on the inputs it got in one forward of the whole model (so rotary
embeddings and masks are the model's own), `--repeats` times after a warm-up, backward from a
random upstream gradient. Issue 41's goal: the GDN layers no slower per token than the attention
layer by more than the kernels' own ratio.

    python benchmarks/layer_time.py --preset qwen3.5-9b-4l --seq 4096           # on a GPU
    python benchmarks/layer_time.py --preset tiny-qwen3.5 --seq 128 --device cpu --repeats 2

One JSON line per layer (kind, ms forward + backward, us per token), one per kernel, and a last
one with the two ratios.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_step import PRESETS  # noqa: E402  (the random-model shapes)

PRESETS = {name: preset for name, preset in PRESETS.items() if "qwen3.5" in name
           and "moe" not in name and "vl" not in name}   # the dense Qwen3.5 shapes
PRESETS["tiny-qwen3.5"] = dict(
    model_type="qwen3_5", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=4096)


def seconds(fn, repeats: int, device: torch.device) -> float:
    """The median wall time of fn() over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def forward_backward(fn, inputs, upstream):
    """A closure: fn(*leaves) forward, then backward of <output, upstream>."""
    def run():
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        (out.float() * upstream).sum().backward()
    return run


def layer_inputs(model, tokens: torch.Tensor) -> list:
    """Each decoder layer's (args, kwargs) in one forward of `model` on `tokens` [1, seq]."""
    captured = []
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kwargs: captured.append((args, kwargs)), with_kwargs=True)
        for layer in model.decoder.layers]
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    with torch.no_grad():
        model(input_ids=tokens, position_ids=positions, attention_mask=None)
    for hook in hooks:
        hook.remove()
    return captured


def time_layers(model, tokens: torch.Tensor, repeats: int) -> list:
    rows = []
    for index, (layer, (args, kwargs)) in enumerate(zip(model.decoder.layers,
                                                        layer_inputs(model, tokens))):
        hidden = kwargs.pop("hidden_states", None)
        hidden = args[0] if hidden is None else hidden
        upstream = torch.randn_like(hidden, dtype=torch.float32)
        step = forward_backward(lambda h: layer(h, *args[1:], **kwargs), [hidden], upstream)
        kind = "gdn" if "GatedDeltaNet" in type(layer.self_attention).__name__ else "attention"
        s = seconds(step, repeats, tokens.device)
        rows.append(dict(name="layer", index=index, kind=kind, ms=round(s * 1e3, 3),
                         us_per_token=round(s * 1e6 / tokens.shape[1], 3)))
    return rows


def time_kernels(hf: dict, seq: int, dtype: torch.dtype, device: torch.device,
                 repeats: int) -> dict:
    """{kind: seconds} of the two cores alone at the model's head counts and widths."""
    from megatron.core.ssm import gated_delta_net

    from swift_megatron.model import gdn

    heads, dk, dv = (hf["linear_num_value_heads"], hf["linear_key_head_dim"],
                     hf["linear_value_head_dim"])
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq, heads, dk, device=device), dim=-1)
            .to(dtype) for _ in range(2))
    v = torch.randn(1, seq, heads, dv, device=device, dtype=dtype)
    g = -torch.nn.functional.softplus(torch.randn(1, seq, heads, device=device))
    beta = torch.sigmoid(torch.randn(1, seq, heads, device=device)).to(dtype)
    rule = gdn.chunk_gated_delta_rule if device.type == "cuda" else \
        gated_delta_net.torch_chunk_gated_delta_rule
    gdn_step = forward_backward(lambda *x: rule(*x[:3], g=x[3], beta=x[4])[0],
                                [q, k, v, g, beta], torch.randn(1, seq, heads, dv, device=device))
    nq, nkv, dh = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    aq = torch.randn(1, nq, seq, dh, device=device, dtype=dtype)
    ak, av = (torch.randn(1, nkv, seq, dh, device=device, dtype=dtype) for _ in range(2))
    attention_step = forward_backward(
        lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, is_causal=True, enable_gqa=True), [aq, ak, av],
        torch.randn(1, nq, seq, dh, device=device))
    return {"gdn": seconds(gdn_step, repeats, device),
            "attention": seconds(attention_step, repeats, device)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-9b-4l", choices=sorted(PRESETS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="auto")
    a = parser.parse_args()
    from transformers import AutoConfig

    from swift_megatron.model.build import build_model
    from swift_megatron.parallel.state import ParallelState
    from swift_megatron.platform.kernels import gdn_kernel_problem

    problem = gdn_kernel_problem()   # what `megatron rlhf` checks first (a Hopper GPU's Triton)
    if problem:
        parser.error(problem)

    state = ParallelState.initialize(device=a.device, seed=0)
    dtype = torch.bfloat16 if state.device.type == "cuda" else torch.float32
    values = dict(PRESETS[a.preset])
    values.pop("model_type")   # the text stack's own config, built as the Qwen3.5 family
    hf = AutoConfig.for_model("qwen3_5_text", **values).to_dict()
    model, _, shape = build_model(hf, dtype, state.device, model_type="qwen3_5")
    tokens = torch.randint(0, shape.vocab_size, (1, a.seq), device=state.device)
    rows = time_layers(model.train(), tokens, a.repeats)
    kernels = time_kernels(hf, a.seq, dtype, state.device, a.repeats)
    for row in rows:
        print(json.dumps(dict(row, preset=a.preset, seq=a.seq)), flush=True)
    for kind, s in kernels.items():
        print(json.dumps(dict(name="kernel", kind=kind, ms=round(s * 1e3, 3),
                              us_per_token=round(s * 1e6 / a.seq, 3))), flush=True)
    mean = {kind: sum(r["ms"] for r in rows if r["kind"] == kind) /
            max(1, sum(r["kind"] == kind for r in rows)) for kind in ("gdn", "attention")}
    print(json.dumps(dict(name="layer_time/ratio", preset=a.preset, seq=a.seq,
                          layer_gdn_over_attention=round(mean["gdn"] / mean["attention"], 3),
                          kernel_gdn_over_attention=round(kernels["gdn"] / kernels["attention"],
                                                          3))), flush=True)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
