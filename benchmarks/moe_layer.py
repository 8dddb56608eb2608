"""Train-step speed of MoE layer shapes against a dense one, on one device, without vLLM: one
packed micro-batch (forward + backward through megatron's schedule, DDP gradient buffers,
logprobs chunked as the trainer computes them; no optimizer step) of a random model.
Feeds docs/gpu.md, "Not yet measured on the current code" until its first GPU run (device_run.sh's
`moe_layer`), then "Qwen3.5, MoE and vision-language models with vLLM".

    python benchmarks/moe_layer.py --preset qwen3-30b-a3b-8l qwen3.5-35b-a3b-8l qwen2.5-1.5b \\
        --variants megatron grouped --profile                                  # on a GPU
    python benchmarks/moe_layer.py --preset tiny-moe --tokens 256 --seq_len 64 --steps 1 \\
        --device cpu --profile

Presets: benchmarks/grpo_step.py's (`qwen3-30b-a3b-8l`: 8 of Qwen3-30B-A3B's layers, all 128
experts, top 8; `qwen3.5-35b-a3b-8l`: 8 of Qwen3.5-35B-A3B's hybrid layers, all 256 experts;
`qwen3-moe-4l`, `qwen3.5-moe-8l` (64 experts), `qwen2.5-1.5b`, ...) plus `tiny-moe`;
`--layers N` changes the depth.
Variants of the MoE layers (one model each; a dense preset runs once):

    grouped     grouped-GEMM experts and the device-side dispatch (the default)
    sequential  SequentialMLP with the device-side dispatch (--moe_grouped_gemm false)
    megatron    SequentialMLP with megatron-core's own dispatcher: the code before both

One JSON line per preset and variant: seconds per step (median over --steps after --warmup),
train tokens/s, model TFLOP/s by active parameters (planning/cost.py: 6 x the parameters a
token multiplies by, routed experts top-k only, the output head included, plus the causal
attention products of --seq_len-token sequences) and its share of the GPU's bf16 peak, peak
memory. With --profile also, for one more step under torch.profiler, the time of each part:
attention / gated_deltanet, router, dispatch (routing, permutation, all-to-all), experts,
combine, shared_expert, mlp (dense), head (output layer and logprobs), embedding, other
(norms, residuals, the schedule): on a GPU the kernels' device time, on a CPU the operators'
host time. Backward work counts for the part whose forward made it (autograd sequence
numbers); the operator count and the GEMM operators by name (aten::matmul wraps an mm on
some devices). And the host synchronisations of one step: on a GPU torch's sync debug mode's
warnings, everywhere the calls platform/host_syncs.py counts (whole step; one MoE layer's
forward and backward alone).
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_step import PRESETS  # noqa: E402  (the random-model shapes)
from trl_compare import bf16_peak_tflops  # noqa: E402

PRESETS = dict(PRESETS, **{"tiny-moe": dict(
    model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False)})
TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
VARIANTS = {"grouped": (True, False), "sequential": (False, False), "megatron": (False, True)}
SYNC_WARNING = "called a synchronizing CUDA operation"
GEMMS = ("aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm")


def hf_config(preset: str, layers: int = 0) -> dict:
    """The preset's HF config as transformers writes it (the text stack for Qwen3.5)."""
    from transformers import AutoConfig

    values = {k: v for k, v in PRESETS[preset].items() if k not in ("image_size", "vision_config")}
    family = values.pop("model_type")
    if layers:
        values["num_hidden_layers"] = layers
    return AutoConfig.for_model(TEXT_TYPES.get(family, family), **values).to_dict()


def packed_batch(vocab: int, tokens: int, seq_len: int, device) -> dict:
    """Random tokens in sequences of seq_len packed back to back (the trainer's THD layout)."""
    lengths = [seq_len] * (tokens // seq_len)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return dict(tokens=ids.to(device), position_ids=positions.to(device),
                cu_seqlens=cu.to(device), max_seqlen=seq_len)


def head_loss(vocab: int):
    def loss_fn(micro_batch, output):
        with torch.profiler.record_function("part:head"):
            targets = micro_batch["tokens"].roll(-1, dims=1)[0]
            return -output.logprobs(targets, 1.0, vocab).mean(), {}
    return loss_fn


def build(hf: dict, family: str, grouped: bool, megatrons: bool, state):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from swift_megatron.model.build import build_model
    from swift_megatron.training.optim import wrap_ddp

    dtype = torch.bfloat16 if state.device.type == "cuda" else torch.float32
    model, config, _ = build_model(hf, dtype, state.device, model_type=family,
                                   moe_grouped_gemm=grouped)
    if megatrons:
        for layer in model.decoder.layers:
            if hasattr(layer.mlp, "token_dispatcher"):
                layer.mlp.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
    return wrap_ddp(model, config, use_distributed_optimizer=False), model


def train_step(ddp, batch: dict, vocab: int):
    from swift_megatron.training.step import forward_backward

    ddp.zero_grad_buffer()
    forward_backward([ddp], [batch], head_loss(vocab))


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


# ---- profile: the time of each part ---------------------------------------------------------

def _label(module_name: str, module) -> str:
    kind = type(module).__name__
    if module_name.endswith("self_attention"):
        return "gated_deltanet" if "GatedDeltaNet" in kind else "attention"
    for suffix, part in ((".router", "router"), (".experts", "experts"),
                         (".shared_experts", "shared_expert"), ("embedding", "embedding")):
        if module_name.endswith(suffix):
            return part
    return "mlp" if module_name.endswith(".mlp") and "MoE" not in kind else ""


def _ranged(fn, part: str):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"part:{part}"):
            return fn(*args, **kwargs)
    return wrapper


def mark_parts(model) -> None:
    """Profiler ranges `part:<name>` around the modules and dispatcher steps of each part."""
    for name, module in model.named_modules():
        part = _label(name, module)
        if part:
            module.forward = _ranged(module.forward, part)
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is not None:
            for step, part in (("dispatch_preprocess", "dispatch"), ("token_dispatch", "dispatch"),
                               ("dispatch_postprocess", "dispatch"),
                               ("combine_preprocess", "combine"), ("token_combine", "combine"),
                               ("combine_postprocess", "combine")):
                setattr(dispatcher, step, _ranged(getattr(dispatcher, step), part))


def _range_of(event):
    while event is not None:
        if event.name.startswith("part:"):
            return event.name[5:]
        if event.name.startswith("autograd::engine::evaluate_function"):
            return ("backward", event.sequence_nr)
        event = event.cpu_parent
    return None


def part_times(events, device: bool) -> dict:
    """ms per part: each operator's self time (device kernels, or host), backward operators
    counted for the part whose forward operator has their autograd sequence number."""
    forward = {}
    for event in events:
        found = _range_of(event)
        if isinstance(found, str) and event.sequence_nr >= 0:
            forward.setdefault(event.sequence_nr, found)
    totals = {}
    for event in events:
        spent = event.self_device_time_total if device else event.self_cpu_time_total
        if not spent or event.name.startswith(("part:", "ProfilerStep")):
            continue
        found = _range_of(event)
        part = forward.get(found[1], "other") if isinstance(found, tuple) else found or "other"
        totals[part] = totals.get(part, 0.0) + spent / 1e3
    return {part: round(ms, 3) for part, ms in sorted(totals.items(), key=lambda kv: -kv[1])}


def profile_step(ddp, model, batch, vocab, device) -> dict:
    mark_parts(model)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        train_step(ddp, batch, vocab)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    gemms = {}
    for event in events:
        if event.name in GEMMS:
            gemms[event.name] = gemms.get(event.name, 0) + 1
    return dict(parts_ms=part_times(events, device.type == "cuda"), operators=len(events),
                gemm_calls=gemms)


# ---- host synchronisations ------------------------------------------------------------------

def host_syncs(step, device) -> dict:
    """{"calls": HostSyncCounter's counts, "cuda_sync_warnings": torch's sync debug mode's
    (CUDA only)} of one call of `step`."""
    from swift_megatron.platform.host_syncs import HostSyncCounter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncCounter() as counter:
                step()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    result = dict(calls=dict(counter.counts))
    if device.type == "cuda":
        result["cuda_sync_warnings"] = sum(SYNC_WARNING in str(w.message) for w in caught)
    return result


def moe_layer_step(model, tokens: int):
    """One MoE layer's forward and backward on random hidden states, or None (dense model)."""
    layer = next((l.mlp for l in model.decoder.layers if hasattr(l.mlp, "router")), None)
    if layer is None:
        return None
    x = torch.randn(tokens, 1, model.config.hidden_size, device=next(model.parameters()).device,
                    dtype=model.config.params_dtype, requires_grad=True)

    def step():
        out, _ = layer(x)
        out.backward(torch.ones_like(out))
    return step


# ---- one preset and variant -----------------------------------------------------------------

def measure(preset: str, variant: str, a, state) -> dict:
    from swift_megatron.planning.cost import active_parameters, attention_flops_per_token

    hf = hf_config(preset, a.layers)
    family = PRESETS[preset]["model_type"]
    ddp, model = build(hf, family, *VARIANTS.get(variant, (True, False)), state)
    vocab = hf["vocab_size"]
    batch = packed_batch(vocab, a.tokens, a.seq_len, state.device)
    for _ in range(a.warmup):
        train_step(ddp, batch, vocab)
    if state.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_s = statistics.median(timed(lambda: train_step(ddp, batch, vocab), state.device)
                               for _ in range(a.steps))
    tokens = batch["tokens"].numel()
    flops = (6 * active_parameters(hf) + attention_flops_per_token(hf, a.seq_len)) * tokens
    row = dict(name="moe_layer", preset=preset, variant=variant,
               layers=hf["num_hidden_layers"], tokens=tokens, seq_len=a.seq_len,
               step_s=round(step_s, 4), tokens_per_s=round(tokens / step_s, 1),
               tflops=round(flops / step_s / 1e12, 2))
    peak = bf16_peak_tflops() if state.device.type == "cuda" else None
    if peak:
        row["mfu"] = round(flops / step_s / 1e12 / peak, 4)
    if state.device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if a.profile:
        row["syncs_step"] = host_syncs(lambda: train_step(ddp, batch, vocab), state.device)
        layer_step = moe_layer_step(model, a.tokens)
        if layer_step is not None:
            row["syncs_moe_layer"] = host_syncs(layer_step, state.device)
        row.update(profile_step(ddp, model, batch, vocab, state.device))
    del ddp, model
    gc.collect()            # the profiler's wrappers hold the modules in reference cycles
    if state.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b-8l"],
                        choices=sorted(PRESETS))
    parser.add_argument("--variants", nargs="+", default=["grouped"], choices=sorted(VARIANTS))
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (default: the "
                        "preset's)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    parser.add_argument("--seq_len", type=int, default=256, help="tokens per packed sequence")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="auto")
    a = parser.parse_args()
    from swift_megatron.parallel.state import ParallelState

    from swift_megatron.platform.kernels import gdn_kernel_problem

    state = ParallelState.initialize(device=a.device, seed=0)
    for preset in a.preset:
        problem = gdn_kernel_problem() if "qwen3_5" in PRESETS[preset]["model_type"] else None
        if problem:      # what `megatron rlhf` refuses first (a Hopper GPU's Triton)
            print(json.dumps(dict(name="moe_layer", preset=preset, error=problem)), flush=True)
            continue
        moe = "num_experts" in PRESETS[preset]
        for variant in (a.variants if moe else a.variants[:1]):
            print(json.dumps(measure(preset, variant if moe else "dense", a, state)),
                  flush=True)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
