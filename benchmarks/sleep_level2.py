"""Which step of our colocate flow breaks vLLM sleep level 2, and which candidate fix works:
one JSON line per variant (one fresh in-process engine per group of variants, each group in its
own subprocess), then a summary line.

Every variant generates greedily (G0), puts the engine to sleep, loads the checkpoint's tensors
again, wakes it up and generates again (G1); `greedy_unchanged` says whether G1 == G0 (tokens),
`logprob_max_diff` compares the logprobs of the tokens before the first difference. A probe in
the process checksums (float64 sum and abs-sum) EVERY tensor of the engine's device reachable
through gc.get_objects() (the model's parameters and buffers, attention impls, metadata builders,
the model runner's buffers, CUDA-graph static inputs ...), KV-cache storages excluded, right
after G0 and right after the final wake-up; `changed_tensors` lists the ones that differ, named
by parameter / buffer / attribute path (or the type of what holds them), and `moved` the model
parameters and buffers whose data_ptr changed (a CUDA graph keeps reading the old address).
When a variant breaks, three repairs are tried on the same engine, each followed by another
generation: `copy_back` writes the pre-sleep values back into the changed tensors (restores ->
those tensors ARE the cause), `reload_awake` loads the weights again with everything awake,
`process_weights` runs vLLM's process_weights_after_loading over the model.

Groups (run in this order while --budget_s allows; when `ours` breaks, the rest in BROKEN_ORDER,
fixes first; --groups picks some, run in the order given):
  ours            ColocateEngine(sleep_level 2) exactly as the trainer: torch.distributed up
                  (external launcher), load_format dummy, update_weights(CUDA tensors made lazily,
                  as the bridge export does) before G0; sleep(); update_weights(); wake_up().
                  Then, on the same engine while it is healthy (`ours` unchanged, or a repair
                  restored it; else they print `skipped`), the fixes chained (`chained`: true):
                  ours_wake_all_first (wake everything before the update), ours_cpu_tensors,
                  ours_process_after_load (process_weights_after_loading after the update)
  ours_level1     `ours` at level 1 (control), then `ours_level2_after_level1` on the same engine
                  (rollout.py's measure_sleep order, where the failure was seen)
  plain           the issue's experiment: vllm.LLM from disk, sleep(2), wake weights, load CPU
                  tensors, wake kv_cache (`plain`); then on the same engine the same with CUDA
                  tensors made after waking the weights (`plain_gpu_tensors`)
  dummy_start     plain LLM with load_format dummy, the checkpoint loaded before G0, then `plain`
  ours_eager      `ours` with enforce_eager (no torch.compile, no CUDA graphs)
  ours_real_start `ours` with load_format auto (real weights from disk at start)
  ours_no_dist    `ours` without torch.distributed (vLLM's uniproc executor)
  ours_wake_all_first, ours_cpu_tensors, ours_process_after_load: the chained fixes again, each
                  on a fresh engine (only if the budget is left)

Reading the output (the `summary` line lists variant@group unchanged / changed, and the
`suspects`: tensors changed in a broken variant and in no unchanged one):
  - `ours` unchanged but `ours_level2_after_level1` changed: the loss needs a level-1 cycle
    first (the benchmark's order; the trainer never mixes levels) -> allow level 2, fix the test;
  - `ours` changed, `plain` unchanged: the first unchanged of dummy_start (changed = the dummy
    start), ours_real_start, ours_no_dist, ours_eager and the chained fixes names the step
    and a fix; `ours_eager` unchanged = compiled code / CUDA graphs read lost state;
  - repairs of the first broken variant: `copy_back.restores` -> the `changed_tensors` (and
    `suspects`) ARE the cause: back them up around a level-2 sleep, or re-create them;
    only `reload_awake` -> the load while asleep loses something: wake everything first;
    only `process_weights` -> vLLM's post-processing must run again after an update;
    none, nothing in `changed_tensors` / `moved` -> state outside Python's reach (CUDA-graph
    pool, Inductor constants): compare with `ours_eager`.

Reading of vLLM's sleep code (0.32 installed here, vllm/v1/worker/gpu_worker.py and
vllm/device_allocator/{cumem,sleep_mode_backend}.py; the older worker in the code index is the
same for what follows): Worker.load_model allocates everything GPUModelRunner.load_model makes
under the CuMem tag "weights" (parameters, buffers, and any other tensor the model, its
quant methods / attention impls or process_weights_after_loading create);
initialize_from_config allocates the KV caches AND what initialize_kv_cache builds (attention
metadata builders' persistent buffers, in 0.32 also the InputBatch) under "kv_cache" (0.32
moved the latter to a "runtime" tag). Worker.sleep(level=2) backs up model.named_buffers() only,
then CuMemAllocator.sleep offloads tag "weights" at level 1 and nothing at level 2: every
"weights" allocation that is neither a parameter (our update rewrites those) nor a registered
buffer comes back as uninitialised memory. 0.32 additionally keeps "runtime" and "cudagraph"
(CUDA-graph pool) allocations at every level and offers `sleep_preserve_parameter_names` for
parameters the sender omits: both are fixes of exactly this class of loss. Candidates:
  (a) a non-parameter, non-buffer tensor made during load_model (rotary caches not registered as
      buffers, attention scale tensors, quant-method / process_weights_after_loading products),
      lost at level 2 -> `changed_tensors` names it; copy_back restores; process_weights may;
  (b) a parameter re-bound by a weight loader (param.data = new) or by process_weights_after_
      loading: its checksum matches but CUDA graphs / compiled code read the old address, which
      level 1 restores and level 2 leaves garbage -> `moved`, ours_eager passes;
  (c) CUDA-graph pool / Inductor constants allocated in a discarded pool -> nothing changes in
      the probe, ours_eager passes, copy_back and reload do not restore;
  (d) the dummy start (dummy_start / ours_real_start differ from plain / ours), our torch.
      distributed external launcher (ours_no_dist), CUDA vs CPU tensors, the wake order.

    python benchmarks/sleep_level2.py                                  # GPU, ~5-6 min
    python benchmarks/sleep_level2.py --preset tiny --dtype float32 --budget_s 1100   # CPU, ~3 min
"""
import argparse
import gc
import json
import math
import os
import socket
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

CAP = 30            # changed tensors listed per variant
COPY_CAP = 8 << 30  # bytes of pre-sleep copies kept for the copy_back repair
# group -> engine options and its cycles (variant name, cycle options), in priority order
GROUPS = {
    # the fixes chained after `ours` run on its engine only while it is healthy (`ours` unchanged
    # or a repair restored it); the same fixes on fresh engines come last
    "ours": dict(engine="ours", cycles=[
        ("ours", {}), ("ours_wake_all_first", {"wake_all_first": True}),
        ("ours_cpu_tensors", {"cuda": False}),
        ("ours_process_after_load", {"process_after_load": True})]),
    # rollout.py's sequence (level 1, then level 2 on the same engine)
    "ours_level1": dict(engine="ours", cycles=[("ours_level1", {"level": 1}),
                                               ("ours_level2_after_level1", {})]),
    "plain": dict(engine="plain", cycles=[("plain", {}), ("plain_gpu_tensors", {"cuda": True})]),
    "dummy_start": dict(engine="plain", load_format="dummy", cycles=[("dummy_start", {})]),
    "ours_eager": dict(engine="ours", eager=True, cycles=[("ours_eager", {})]),
    "ours_real_start": dict(engine="ours", load_format="auto", cycles=[("ours_real_start", {})]),
    "ours_no_dist": dict(engine="ours", dist=False, cycles=[("ours_no_dist", {})]),
    "ours_wake_all_first": dict(engine="ours", cycles=[("ours_wake_all_first",
                                                        {"wake_all_first": True})]),
    "ours_cpu_tensors": dict(engine="ours", cycles=[("ours_cpu_tensors", {"cuda": False})]),
    "ours_process_after_load": dict(engine="ours", cycles=[("ours_process_after_load",
                                                            {"process_after_load": True})]),
}


# the order after `ours` when it broke: the fixes on fresh engines first (those that already
# ran chained on a repaired `ours` engine are left out)
BROKEN_ORDER = ["plain", "ours_real_start", "ours_wake_all_first", "ours_eager", "dummy_start",
                "ours_cpu_tensors", "ours_process_after_load", "ours_level1", "ours_no_dist"]


def emit(name: str, **fields) -> None:
    print(json.dumps({"name": name, **fields}), flush=True)


# ---- model and inputs ---------------------------------------------------------------------------
def write_model(preset: str, work_dir: str, dtype: str) -> str:
    """The random checkpoint of `preset` (grpo_step's presets; "tiny" is rollout.py's head_dim-32
    Qwen3 for vLLM's CPU attention), written once."""
    out = os.path.join(work_dir, f"{preset}-{dtype}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    if preset == "tiny":
        import rollout
        from swift_megatron.fixtures import build_tiny_model

        shape = dict(rollout.TINY)
        return build_tiny_model(shape.pop("model_type"), out, dtype=dtype, **shape)
    import grpo_step

    return grpo_step.build_model(preset, out, dtype)


def prompts_of(a):
    import torch

    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 500, (a.prompts, a.prompt_len), generator=gen).tolist()


# ---- the engine under test ----------------------------------------------------------------------
class Run:
    """One engine (ours: ColocateEngine; plain: vllm.LLM) and the flow's steps on it."""

    def __init__(self, a, group: dict):
        import torch

        from swift_megatron.rollout import vllm_compat

        self.a, self.group, self.compat = a, group, vllm_compat
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.eos = [eos_id(a.model_dir)]
        self.weights = load_checkpoint(a.model_dir)
        kind, load_format = group["engine"], group.get("load_format")
        start = time.perf_counter()
        if kind == "ours":
            if group.get("dist", True):
                init_dist(self.dev)
            from swift_megatron.rollout.vllm_colocate import ColocateEngine, ColocateSettings

            settings = ColocateSettings(
                a.model_dir, dtype=a.dtype, sleep_level=2,
                gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.max_model_len,
                max_num_seqs=a.prompts, enforce_eager=group.get("eager", False),
                engine_kwargs={"load_format": load_format} if load_format else {})
            self.engine = ColocateEngine(settings, eos_token_ids=self.eos)
            self.llm = self.engine.llm
        else:
            vllm = vllm_compat.import_vllm()
            self.engine = None
            self.llm = vllm.LLM(
                model=a.model_dir, dtype=a.dtype, seed=0, load_format=load_format or "auto",
                enable_sleep_mode=vllm_compat.sleep_mode_available(),
                gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.max_model_len,
                max_num_seqs=a.prompts, disable_log_stats=True)
        # in-process: the worker itself (unwrapped from vLLM's WorkerWrapperBase)
        self.worker = self.llm.collective_rpc(lambda w: getattr(w, "worker", None) or w)[0]
        if kind == "ours" or load_format == "dummy":   # the first weights, before any rollout
            self.load(cuda=kind == "ours")
        emit("engine", group=a.child, seconds=round(time.perf_counter() - start, 1),
             vllm=vllm_compat.import_vllm().__version__, device=self.dev)

    @property
    def model(self):
        return self.worker.model_runner.get_model()

    def tensors(self, cuda: bool):
        """The checkpoint's tensors; CUDA ones made lazily (while the update runs, as the
        bridge's export makes them)."""
        for name, tensor in self.weights.items():
            yield name, tensor.to(self.dev) if cuda else tensor

    def load(self, cuda: bool) -> None:
        """The flow's weight load: ours through update_weights (wakes "weights" first when
        asleep), plain through the model's load_weights (vllm_compat's path for the CPU)."""
        if self.engine is not None:
            self.engine.update_weights(self.tensors(cuda))
            return
        w = self.worker
        self.compat.begin_weight_update(w)
        self.compat.load_weights(w, list(self.tensors(cuda)))
        self.compat.finish_weight_update(w)

    def process_weights(self) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(self.model, self.worker.vllm_config.model_config,
                                      self.worker.device)

    def generate(self):
        from swift_megatron.rollout.engine import SamplingConfig

        prompts = prompts_of(self.a)
        if self.engine is not None:
            out = self.engine.generate(prompts, SamplingConfig(max_tokens=self.a.max_tokens,
                                                               temperature=0.0))
            return [(c.token_ids, c.logprobs) for c in out]
        params = self.compat.sampling_params(self.a.max_tokens, 0.0, 1.0, -1, 1.0, None, self.eos)
        outputs = self.llm.generate(self.compat.prompt_inputs(prompts), params, use_tqdm=False)
        return [self.compat.completion_fields(o)[:2] for o in outputs]

    def cycle(self, level: int, cuda: bool, wake_all_first: bool, process_after_load: bool):
        """sleep -> (load) -> wake up, as the flow under test does it."""
        if self.engine is not None:
            self.engine.settings.sleep_level = level
            self.engine.sleep()
            if wake_all_first:
                self.engine.wake_up()
            self.load(cuda)
            if process_after_load:
                self.process_weights()
            self.engine.wake_up()
            return
        self.compat.sleep(self.llm, level)
        self.compat.wake_up(self.llm, ["weights"])
        self.load(cuda)
        if process_after_load:
            self.process_weights()
        self.compat.wake_up(self.llm, ["kv_cache"])


def eos_id(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


def load_checkpoint(model_dir: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


def init_dist(dev: str) -> None:
    """torch.distributed as a training process has it (ColocateEngine then uses vLLM's external
    launcher, as in `megatron rlhf`)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")


# ---- the probe ----------------------------------------------------------------------------------
def tkey(t):
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))


def kv_storages(worker) -> set:
    """data_ptrs of the KV caches' storages (the model runner's and the attention layers')."""
    import torch

    ptrs = set()

    def add(x):
        if isinstance(x, torch.Tensor):
            ptrs.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (list, tuple)):
            for y in x:
                add(y)
        elif isinstance(x, dict):
            for y in x.values():
                add(y)

    runner = worker.model_runner
    add(getattr(runner, "kv_caches", None))
    context = getattr(runner.vllm_config.compilation_config, "static_forward_context", {}) or {}
    for layer in context.values():
        add(getattr(layer, "kv_cache", None))
    return ptrs


def probe_tensors(dev: str, exclude: set) -> dict:
    """{key: tensor} of every plain tensor / Parameter on `dev` that gc sees, KV caches excluded."""
    import torch

    gc.unfreeze()   # vLLM gc.freeze()s its start-up objects: gc.get_objects() would skip them
    gc.collect()
    found = {}
    with warnings.catch_warnings():   # isinstance on deprecated module aliases warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [obj for obj in objects if _is_tensor(obj, torch)]
    del objects
    for obj in tensors:
        try:
            if obj.device.type != dev or obj.layout != torch.strided or obj.numel() == 0:
                continue
            if obj.untyped_storage().data_ptr() in exclude:
                continue
            found.setdefault(tkey(obj), obj)
        except Exception:   # objects whose attributes cannot be read
            continue
    return found


def _is_tensor(obj, torch) -> bool:
    """A plain tensor or a Parameter (not the compiler's FakeTensors and other subclasses)."""
    try:
        return isinstance(obj, torch.Tensor) and (type(obj) is torch.Tensor
                                                  or isinstance(obj, torch.nn.Parameter))
    except Exception:   # objects whose __class__ cannot be read
        return False


def real_tensor_mode():
    """Leaves a FakeTensor mode the compiler may have left active (seen on an H200 with vLLM
    0.26 once an engine came from the compile cache: the probe's torch.stack raised "Please
    convert all Tensors to FakeTensors first")."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def checksums(found: dict) -> dict:
    import torch

    if not found:
        return {}
    with real_tensor_mode(), torch.inference_mode():
        sums = torch.stack([torch.stack([t.double().sum(), t.double().abs().sum()])
                            for t in found.values()]).cpu().tolist()
    return dict(zip(found, sums))


def model_pointers(model) -> dict:
    pairs = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    return {name: t.data_ptr() for name, t in pairs}


class Snapshot:
    """Checksums of the probed tensors (and, before the sleep, CPU copies for copy_back)."""

    def __init__(self, run: Run, copies: bool):
        with real_tensor_mode():
            self._take(run, copies)

    def _take(self, run: Run, copies: bool):
        self.found = probe_tensors(run.dev, kv_storages(run.worker))
        self.sums = checksums(self.found)
        self.pointers = model_pointers(run.model)
        self.copies = {}
        if copies:
            budget = COPY_CAP
            for key, t in self.found.items():
                size = t.numel() * t.element_size()
                if size <= budget:
                    self.copies[key] = t.detach().to("cpu", copy=True)
                    budget -= size
            self.found = {}   # keep no references across the sleep


def same(x, y) -> bool:
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(x, y))


def tensor_names(run: Run, keys: set) -> dict:
    """Best names for the tensors `keys`: model parameter / buffer names, then attribute paths
    from the model's modules, the model runner and the worker."""
    import types

    import torch

    model = run.model
    names = {}
    for prefix, pairs in (("param", model.named_parameters(remove_duplicate=False)),
                          ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in pairs:
            names.setdefault(tkey(t), f"{prefix}:{name}")
    modules = dict(model.named_modules())
    seen = {id(m) for m in modules.values()}
    budget = [300_000]
    skip = (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType,
            types.MethodType, types.BuiltinFunctionType)

    def walk(obj, path, depth):
        if isinstance(obj, skip) or id(obj) in seen or budget[0] <= 0:
            return
        seen.add(id(obj))
        budget[0] -= 1
        try:
            if isinstance(obj, torch.Tensor):
                if obj.device.type == run.dev and obj.layout == torch.strided:
                    names.setdefault(tkey(obj), path)
                return
            if depth == 0:
                return
            if isinstance(obj, dict):
                for k, v in list(obj.items())[:512]:
                    walk(v, f"{path}[{k!r}]", depth - 1)
            elif isinstance(obj, (list, tuple, set)):
                for i, v in enumerate(list(obj)[:256]):
                    walk(v, f"{path}[{i}]", depth - 1)
            elif hasattr(obj, "__dict__"):
                for k, v in list(vars(obj).items()):
                    if not (isinstance(obj, torch.nn.Module) and k in
                            ("_parameters", "_buffers", "_modules")):
                        walk(v, f"{path}.{k}", depth - 1)
        except Exception:
            return

    for name, module in modules.items():
        for k, v in list(vars(module).items()):
            if k not in ("_parameters", "_buffers", "_modules"):
                walk(v, f"model.{name}.{k}" if name else f"model.{k}", 3)
    walk(run.worker.model_runner, "runner", 5)
    walk(run.worker, "worker", 3)
    return {k: names[k] for k in keys if k in names}


def holders(t, ignore: set, limit: int = 3) -> list:
    """What refers to tensor `t` (type names; 'Class.attr' for an object's __dict__)."""
    out = []
    for ref in gc.get_referrers(t):
        if id(ref) in ignore or isinstance(ref, type(sys._getframe())):
            continue
        if isinstance(ref, dict):
            owner = next((o for o in gc.get_referrers(ref)
                          if getattr(o, "__dict__", None) is ref), None)
            attr = next((k for k, v in ref.items() if v is t), "?")
            out.append(f"{type(owner).__name__}.{attr}" if owner is not None else f"dict[{attr!r}]")
        else:
            out.append(type(ref).__name__)
        if len(out) >= limit:
            break
    return out


def diff(run: Run, before: Snapshot, after: Snapshot) -> dict:
    changed = [k for k, v in before.sums.items() if k in after.sums and not same(v, after.sums[k])]
    changed.sort(key=lambda k: -after.found[k].numel() * after.found[k].element_size())
    names = tensor_names(run, set(changed[:CAP])) if changed else {}
    unnamed = [k for k in changed[:CAP] if k not in names][:10]
    ignore = {id(after.found), id(before.sums), id(after.sums)}
    listed = []
    for k in changed[:CAP]:
        t = after.found[k]
        entry = dict(name=names.get(k), shape=list(k[1]), dtype=k[3],
                     bytes=t.numel() * t.element_size(),
                     before=[round(x, 6) for x in before.sums[k]],
                     after=[round(x, 6) for x in after.sums[k]])
        if k in unnamed:
            entry["held_by"] = holders(t, ignore)
        listed.append(entry)
    moved = sorted(n for n, p in before.pointers.items() if after.pointers.get(n) != p)
    return dict(probed_tensors=len(before.sums), changed_tensors_total=len(changed),
                changed_tensors=listed, tensors_gone=len(set(before.sums) - set(after.sums)),
                tensors_new=len(set(after.sums) - set(before.sums)), moved=moved[:CAP],
                moved_total=len(moved))


def compare(g0, g1) -> dict:
    changed, first, lp = [], None, 0.0
    tokens = 0
    for i, ((t0, l0), (t1, l1)) in enumerate(zip(g0, g1)):
        pos = next((j for j, (x, y) in enumerate(zip(t0, t1)) if x != y), None)
        if pos is None and len(t0) != len(t1):
            pos = min(len(t0), len(t1))
        if pos is not None:
            changed.append(i)
            first = first or [i, pos]
        common = pos if pos is not None else len(t0)
        tokens += common
        if l0 is not None and l1 is not None and common:
            lp = max(lp, max(abs(x - y) for x, y in zip(l0[:common], l1[:common])))
    return dict(greedy_unchanged=not changed and len(g0) == len(g1),
                sequences_changed=len(changed), sequences=len(g0), first_diff=first,
                logprob_max_diff=lp, tokens_compared=tokens)


def repairs(run: Run, g0, before: Snapshot, after: Snapshot) -> dict:
    """Try to restore G0 on a broken engine: copy_back, then reload_awake, then
    process_weights; each says whether the next generation equals G0 again."""
    import torch

    out = {}
    changed = [k for k, v in before.sums.items() if k in after.sums and not same(v, after.sums[k])]
    copied = [k for k in changed if k in before.copies]
    with real_tensor_mode(), torch.inference_mode():
        for k in copied:
            after.found[k].copy_(before.copies[k].to(after.found[k].device))
    out["copy_back"] = dict(tensors=len(copied), of=len(changed),
                            restores=compare(g0, run.generate())["greedy_unchanged"])
    if out["copy_back"]["restores"]:
        return out
    run.load(cuda=run.dev == "cuda")
    out["reload_awake"] = dict(restores=compare(g0, run.generate())["greedy_unchanged"])
    if out["reload_awake"]["restores"]:
        return out
    try:
        run.process_weights()
        out["process_weights"] = dict(restores=compare(g0, run.generate())["greedy_unchanged"])
    except Exception as exc:   # vLLM may refuse to process a model twice
        out["process_weights"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    return out


def run_group(a) -> None:
    group = GROUPS[a.child]
    run = Run(a, group)
    healthy = True   # False once a cycle changed the output and no repair restored it
    for index, (variant, opts) in enumerate(group["cycles"]):
        level = opts.get("level", 2)
        fields = dict(variant=variant, group=a.child, level=level, chained=index > 0)
        if not healthy:
            emit("variant", skipped="the engine is broken by an earlier cycle", **fields)
            continue
        start = time.perf_counter()
        g0 = run.generate()
        before = Snapshot(run, copies=True)
        process = opts.get("process_after_load", False)
        if process and run.dev != "cuda":
            process = False   # the CPU repacks: see vllm_compat.finish_weight_update
        run.cycle(level, opts.get("cuda", run.dev == "cuda"), opts.get("wake_all_first", False),
                  process)
        after = Snapshot(run, copies=False)
        g1 = run.generate()
        result = dict(compare(g0, g1), **diff(run, before, after))
        if not result["greedy_unchanged"]:
            result["repairs"] = repairs(run, g0, before, after)
            healthy = any(r.get("restores") for r in result["repairs"].values())
        emit("variant", seconds=round(time.perf_counter() - start, 1), **fields, **result)
        del before, after
    if run.engine is not None:
        run.engine.close()


# ---- the parent ---------------------------------------------------------------------------------
def summarize(lines: list, skipped: list) -> None:
    variants = [x for x in lines if x.get("name") == "variant" and "skipped" not in x]

    def label(x):
        return f"{x['variant']}@{x['group']}"

    def names(x):
        return {c["name"] or f"{c['shape']}:{c['dtype']}" for c in x["changed_tensors"]}

    noise = set().union(*[names(x) for x in variants if x["greedy_unchanged"]])
    suspects = set().union(*[names(x) for x in variants if not x["greedy_unchanged"]]) - noise
    emit("summary", unchanged=[label(x) for x in variants if x["greedy_unchanged"]],
         changed=[label(x) for x in variants if not x["greedy_unchanged"]],
         suspects=sorted(suspects)[:CAP], skipped_groups=skipped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--work_dir", default="/tmp/sleep_level2")
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--gpu_memory_utilization", type=float, default=0.2)
    p.add_argument("--budget_s", type=float, default=340,
                   help="start no further group when the next one would end after this")
    p.add_argument("--child", choices=list(GROUPS), help=argparse.SUPPRESS)
    p.add_argument("--model_dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.max_model_len = a.prompt_len + a.max_tokens + 32
    if a.child:
        run_group(a)
        sys.stdout.flush()
        os._exit(0)   # no engine / NCCL teardown at exit: a hang there would eat the budget
    start = time.perf_counter()
    os.makedirs(os.path.join(a.work_dir, "logs"), exist_ok=True)
    model_dir = write_model(a.preset, a.work_dir, a.dtype)
    emit("model", dir=model_dir, seconds=round(time.perf_counter() - start, 1))
    lines, skipped, estimate = [], [], 60.0
    pending, adaptive = list(a.groups), a.groups == list(GROUPS)
    for i in range(len(GROUPS)):
        if not pending:
            break
        group = pending.pop(0)
        done = {x["variant"] for x in lines if x.get("name") == "variant" and "skipped" not in x}
        cycles = [variant for variant, _ in GROUPS[group]["cycles"]]
        if i and all(variant in done for variant in cycles):
            continue   # a fix that already ran chained on the `ours` engine
        elapsed = time.perf_counter() - start
        if i and elapsed + estimate > a.budget_s:
            skipped.append(group)
            continue
        log = os.path.join(a.work_dir, "logs", f"{group}.log")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", group, "--model_dir",
               model_dir] + [f"--{k}={getattr(a, k)}" for k in
                             ("dtype", "prompts", "prompt_len", "max_tokens",
                              "gpu_memory_utilization")]
        t0 = time.perf_counter()
        with open(log, "w") as err:
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                      cwd=REPO, timeout=max(60.0, a.budget_s + 60 - elapsed))
                out, rc = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as exc:
                out, rc = exc.stdout or "", "timeout"
                out = out.decode() if isinstance(out, bytes) else out
        with open(log, "a") as f:   # vLLM logs to stdout: kept with stderr
            f.write("---- stdout ----\n")
            for line in out.splitlines():
                if line.startswith("{"):
                    print(line, flush=True)
                    lines.append(json.loads(line))
                else:
                    f.write(line + "\n")
        if rc != 0:
            with open(log) as f:
                tail = f.read().split("---- stdout ----")[0].splitlines()[-25:]
            emit("group_failed", group=group, rc=rc, log=log, tail=tail)
        if i:   # the first group also compiles (torch.compile cache)
            estimate = max(estimate if i > 1 else 0, time.perf_counter() - t0)
        elif adaptive and any(x.get("variant") == "ours" and x.get("greedy_unchanged") is False
                              for x in lines):
            pending = [g for g in BROKEN_ORDER if g in pending]
    summarize(lines, skipped)
    emit("total", seconds=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
