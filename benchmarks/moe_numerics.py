"""How far bfloat16 numerics alone move the token logprobs of a random Qwen3.5-MoE, and whether
a weight push adds anything (issue 11: the vLLM-vs-trainer logprob gap of the `qwen3.5-moe-8l`
preset).
Feeds docs/gpu.md, "Qwen3.5, MoE and vision-language models with vLLM" (device_run.sh's
moe_numerics) and docs/export.md's MoE tolerance.

Writes a random qwen3_5_moe checkpoint (the fixtures' init, as grpo_step.py's presets; weights
saved in bf16, so every implementation below runs the very same weights) with the preset's
proportions, shrunk by --hidden_size (64 experts, top 8, a shared expert, 8 layers, the real
initializer_range 0.02 by default; attention and Gated DeltaNet heads scaled with the width,
vocab 8192), then, on --sequences random sequences of --length tokens,
the logprob of every next token under:

    hf_fp32            transformers, float32 (the reference)
    hf_bf16            transformers, bfloat16 (router logits computed in bf16, as vLLM's gate)
    mcore_fp32         Megatron through the bridge, float32 (the bridge's exactness)
    mcore_bf16         Megatron bf16, router in fp32 (moe_router_dtype="fp32", what GRPO runs)
    mcore_bf16_router_bf16   Megatron bf16, router in bf16 (moe_router_dtype=None)
    vllm_bf16          vLLM bf16 loaded from disk (prompt_logprobs), unless --no_vllm
    vllm_bf16_pushed   vLLM bf16 started with dummy weights, asleep (level 1) and woken by a
                       push of mcore_bf16's bridge export (a GRPO weight sync), unless --no_vllm

and prints one JSON line per pair (mean / max |logprob difference| over all predicted tokens):
each run against hf_fp32, and the pairs a GRPO run compares (vllm_bf16 vs mcore_bf16).
For scale, `error_*` runs are hf_fp32 with one small sync error in the first layer (SYNC_ERRORS:
its shared-expert gate zeroed, its router rows reversed, its input norm zeroed), against hf_fp32.
A last line `router_topk` counts, in the hf_bf16 run, how often the top-k expert set of a token
differs between router logits computed in fp32 and in bf16 from the same bf16 hidden states
(Megatron's router against vLLM's), per layer and overall.

    python benchmarks/moe_numerics.py --device cpu --hidden_size 512
    python benchmarks/moe_numerics.py --device cuda --hidden_size 2048   # the preset's width
    python benchmarks/moe_numerics.py --device cpu --layers 2 --experts 8 --topk 2 --no_vllm
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden_size", type=int, default=512,
                        help="2048 is the preset's; experts' widths scale with it (1/4)")
    parser.add_argument("--moe_intermediate_size", type=int,
                        help="each expert's and the shared expert's width (default hidden/4, "
                             "the preset's ratio; smaller keeps a wide model in CPU memory)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--initializer_range", type=float, default=0.02)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_vllm", action="store_true")
    parser.add_argument("--model_dir", help="where the checkpoint is written (default: a tmp dir)")
    parser.add_argument("--vllm_worker", nargs="+", metavar="MODEL_DIR TOKENS_PT [PUSHED]",
                        help=argparse.SUPPRESS)   # internal: the vLLM run, in a subprocess
    return parser.parse_args(argv)


def overrides(args) -> dict:
    """The preset's proportions (REAL_SHAPES["qwen3.5-moe-small"]) at width --hidden_size."""
    width = args.moe_intermediate_size or args.hidden_size // 4
    return dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                num_attention_heads=max(2, args.hidden_size // 128), num_key_value_heads=2,
                head_dim=64, linear_num_key_heads=max(1, args.hidden_size // 256),
                linear_num_value_heads=max(2, args.hidden_size // 128),
                linear_key_head_dim=128, linear_value_head_dim=128,
                num_experts=args.experts, num_experts_per_tok=args.topk,
                moe_intermediate_size=width, shared_expert_intermediate_size=width,
                vocab_size=args.vocab_size, max_position_embeddings=4096,
                tie_word_embeddings=False, initializer_range=args.initializer_range)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s-1] float32 logprob of each next token."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1).cpu()


def gap(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a - b).abs()
    return dict(mean=round(diff.mean().item(), 5), max=round(diff.max().item(), 5))


def prompt_logprobs(llm, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s-1] the engine's logprob of every prompt token after the first."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in tokens],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([[entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:],
                                                                row[1:].tolist())]
                         for out, row in zip(outs, tokens)])


def run_vllm(model_dir: str, tokens_path: str, pushed: str = "") -> None:
    """Subprocess: vLLM bf16 loaded from disk, or (`pushed`: a safetensors file of the bridge's
    export) started with dummy weights, put to sleep (level 1, where vLLM can), woken by the
    push as the GRPO colocate engine is; the prompt logprobs are saved next to the tokens."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tokens = torch.load(tokens_path)
    length = tokens.shape[1] + 8
    if not pushed:
        from vllm import LLM

        from swift_megatron.rollout.vllm_compat import model_defaults

        llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=length,
                  gpu_memory_utilization=0.5, seed=0, **model_defaults(model_dir))
        torch.save(prompt_logprobs(llm, tokens), tokens_path + ".vllm")
        return
    from safetensors.torch import load_file

    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

    engine = ColocateEngine(ColocateSettings(model_dir, max_model_len=length, enforce_eager=True,
                                             gpu_memory_utilization=0.5, sleep_level=1),
                            eos_token_ids=[0])
    engine.sleep()
    engine.update_weights(iter(load_file(pushed).items()))
    engine.wake_up()
    torch.save(prompt_logprobs(engine.llm, tokens), tokens_path + ".vllm")


def vllm_logprobs(model_dir: str, tokens: torch.Tensor, pushed: str = "") -> torch.Tensor:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.pt")
        torch.save(tokens.cpu(), path)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--vllm_worker", model_dir,
                        path, *([pushed] if pushed else [])], check=True)
        return torch.load(path + ".vllm")


# small sync errors in the first layer, as a wrong push would make them (float32 transformers)
SYNC_ERRORS = {
    "shared_expert_gate_zero": lambda layer: layer.mlp.shared_expert_gate.weight.zero_(),
    "router_rows_reversed": lambda layer: layer.mlp.gate.weight.copy_(
        layer.mlp.gate.weight.flip(0)),
    "input_norm_zero": lambda layer: layer.input_layernorm.weight.zero_(),
}


def hf_runs(model_dir: str, tokens: torch.Tensor, topk: int):
    """hf_fp32 and hf_bf16 logprobs, the router top-k disagreement of the bf16 run, and float32
    with each of SYNC_ERRORS (`error_<name>`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(tokens.device).eval()
    runs = {}
    with torch.no_grad():
        runs["hf_fp32"] = token_logprobs(model(input_ids=tokens, use_cache=False).logits, tokens)
        saved = {k: v.clone() for k, v in model.model.layers[0].state_dict().items()}
        for name, error in SYNC_ERRORS.items():
            error(model.model.layers[0])
            logits = model(input_ids=tokens, use_cache=False).logits
            runs[f"error_{name}"] = token_logprobs(logits, tokens)
            model.model.layers[0].load_state_dict(saved)
    model = model.to(torch.bfloat16)
    flips = []

    def count(module, inputs):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        in_fp32 = torch.nn.functional.linear(x.float(), module.weight.float())
        in_bf16 = torch.nn.functional.linear(x, module.weight).float()
        a = in_fp32.topk(topk, dim=-1).indices.sort(-1).values
        b = in_bf16.topk(topk, dim=-1).indices.sort(-1).values
        flips.append((a != b).any(-1).float().mean().item())

    hooks = [layer.mlp.gate.register_forward_pre_hook(count) for layer in model.model.layers]
    with torch.no_grad():
        runs["hf_bf16"] = token_logprobs(model(input_ids=tokens, use_cache=False).logits, tokens)
    for hook in hooks:
        hook.remove()
    return runs, flips


def mcore_runs(model_dir: str, tokens: torch.Tensor, device: str, export_to: str = "") -> dict:
    """The three Megatron runs; `export_to`: where the bf16 model's export (what a GRPO weight
    sync sends) is saved as safetensors."""
    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.export import mcore_logits
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.model.text_config import text_config
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(tp=1, device=device, seed=0)
    hf_config = load_hf_config(model_dir)
    model_type = text_config(hf_config)["model_type"]
    out = {}
    for name, dtype, router in (("mcore_fp32", torch.float32, "fp32"),
                                ("mcore_bf16", torch.bfloat16, "fp32"),
                                ("mcore_bf16_router_bf16", torch.bfloat16, None)):
        loaded = load_mcore_model(hf_config, model_type, dtype, state, hf_dir=model_dir)
        routers = [m for m in loaded.model.modules() if type(m).__name__ == "TopKRouter"]
        assert routers, "no TopKRouter in the Megatron model"
        for module in routers:   # read at every forward (TopKRouter.gating)
            module.config.moe_router_dtype = router
        out[name] = token_logprobs(mcore_logits(loaded, tokens, state), tokens)
        if export_to and name == "mcore_bf16":
            from safetensors.torch import save_file

            save_file({k: v.contiguous().cpu() for k, v in loaded.bridge.export([loaded.model])},
                      export_to)
        del loaded
    ParallelState.destroy()
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.vllm_worker:
        run_vllm(*args.vllm_worker)
        return
    from swift_megatron.fixtures import build_tiny_model

    config = dict(device=args.device, hidden_size=args.hidden_size,
                  moe_intermediate_size=overrides(args)["moe_intermediate_size"],
                  layers=args.layers, experts=args.experts, topk=args.topk,
                  initializer_range=args.initializer_range,
                  sequences=args.sequences, length=args.length)
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model_dir or os.path.join(tmp.name, "qwen3_5_moe")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_model("qwen3_5_moe", model_dir, seed=args.seed, dtype="bfloat16",
                         **overrides(args))
    # ids of the fixture tokenizer's vocabulary (vLLM rejects ids beyond the tokenizer's)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, 500, (args.sequences, args.length), generator=generator)
    runs = {}
    if not args.no_vllm:   # first: on a GPU it must find the memory free
        runs["vllm_bf16"] = vllm_logprobs(model_dir, tokens)
    device_tokens = tokens.to(args.device)
    hf, flips = hf_runs(model_dir, device_tokens, args.topk)
    runs.update(hf)
    pushed = "" if args.no_vllm else os.path.join(tmp.name, "pushed.safetensors")
    runs.update(mcore_runs(model_dir, device_tokens, args.device, pushed))
    if pushed:
        if args.device == "cuda":
            torch.cuda.empty_cache()
        runs["vllm_bf16_pushed"] = vllm_logprobs(model_dir, tokens, pushed)
    pairs = [(name, "hf_fp32") for name in runs if name != "hf_fp32"]
    pairs += [("mcore_bf16", "hf_bf16"), ("mcore_bf16_router_bf16", "hf_bf16"),
              ("mcore_bf16_router_bf16", "mcore_bf16")]
    if "vllm_bf16" in runs:
        pairs += [("vllm_bf16_pushed", "vllm_bf16"), ("vllm_bf16", "mcore_bf16"),
                  ("vllm_bf16_pushed", "mcore_bf16"), ("vllm_bf16", "hf_bf16"),
                  ("vllm_bf16", "mcore_bf16_router_bf16")]
    for a, b in pairs:
        print(json.dumps(dict(name="logprob_gap", run=a, against=b, **gap(runs[a], runs[b]),
                              **config)), flush=True)
    print(json.dumps(dict(name="router_topk", tokens_with_other_experts=round(
        sum(flips) / len(flips), 4), per_layer=[round(f, 4) for f in flips], **config)), flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()
