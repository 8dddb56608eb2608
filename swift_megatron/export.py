"""`megatron export`: convert checkpoints between Hugging Face and Megatron-core, apply or merge
LoRA adapters, and measure how closely the Megatron model reproduces the Hugging Face one.

A command names a base model, optionally an adapter, and what to write (ms-swift's forms and
ours; docs/export.md has the table):

    base      --mcore_model (our model directory or an ms-swift checkpoint) or else --model (HF);
              without either, the base an adapter checkpoint holds or names (our LoRA
              checkpoint's own weights, ms-swift's args.json, adapter_config.json)
    adapter   --adapters (a PEFT directory, or a checkpoint holding one) or --mcore_adapter
    --to_mcore true   a Megatron model directory (checkpoint/layout.py) in the layout of the
                      parallel flags; the adapter merged (--merge_lora true) or kept beside the
                      weights as a LoRA checkpoint (default)
    --to_hf true      an HF checkpoint with the adapter merged (default), or the adapter alone in
                      PEFT format (--merge_lora false)
    --merge_lora true alone: --model + --adapters merged into an HF checkpoint
    --test_convert_precision true
                      transformers and Megatron in --test_convert_dtype (float32) on the same
                      random tokens: max / mean absolute logit difference and argmax agreement;
                      fails past --test_convert_precision_atol. Checks what the command wrote
                      (or, alone, the base + adapter) against the HF model (+ adapter, via peft).

cli/export.py parses the flags, calls `prepare` (every check a user can fail, before any
process is launched or model built; `describe` prints its result for --dry_run) and `run`. The
other public functions are the building blocks tests and benchmarks reuse: `load_mcore_model`,
`save_model_dir`, `random_tokens`, `mcore_logits`, `hf_logits`, `round_weights`,
`compare_logits`, `measure_precision`, `check_precision`. Every function that touches a Megatron
model is collective: call it on every rank. torch, megatron and transformers are imported inside
the functions, so that `prepare` can reject a missing path at once.
"""
import contextlib
import dataclasses
import os
import shutil
import time
from typing import TYPE_CHECKING, Optional

from swift_megatron.checkpoint.sources import (AdapterSource, WeightsSource, adapter_source,
                                               load_weights, mcore_source)
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger

if TYPE_CHECKING:
    import torch

    from swift_megatron.arguments.commands import ExportCommandArguments
    from swift_megatron.bridge import Bridge
    from swift_megatron.lora import LoraConfig
    from swift_megatron.model.config import ModelShape
    from swift_megatron.parallel.state import ParallelState

logger = get_logger(__name__)

PRECISION_SEQUENCES = 4   # random sequences the precision check runs
PRECISION_LENGTH = 64     # tokens per sequence (at most max_position_embeddings)
PRECISION_SEED = 0
OUTPUTS = {"mcore": "Megatron model directory", "hf": "HF checkpoint", "peft": "PEFT adapter"}


# ---- inputs ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ExportInputs:
    """What `prepare` resolved: where the weights, config and adapter come from, what is written.
    In a dry run, a hub id is not downloaded: hf_files, hf_config, model_type and the dtypes are
    then None."""

    base: WeightsSource
    hf_files: Optional[str]        # config.json + tokenizer files of the model
    hf_config: Optional[dict]
    model_type: Optional[str]
    source_dtype: Optional[str]    # dtype name of the base weights
    dtype: Optional[str]           # dtype name of the written weights
    base_name: str                 # the base model as named to the user (adapter_config.json)
    adapter: Optional[AdapterSource] = None
    lora: Optional["LoraConfig"] = None
    merge: bool = False            # the adapter is merged into the weights
    output: Optional[str] = None   # "mcore" | "hf" | "peft"; None: precision check only
    reference: Optional[str] = None  # HF weights the precision check compares with
    model_dir: Optional[str] = None  # --model resolved to a local directory


def _is_hub_id(name: str) -> bool:
    return not os.path.exists(name) and name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _resolve_hf(args: "ExportCommandArguments", name: str, origin: str) -> Optional[str]:
    """A local HF directory for `name` (a path or a hub id, downloaded now); None for a hub id in
    a dry run. `origin` says where the name came from, for the error message."""
    from swift_megatron.model.hub import resolve_model_dir

    if args.export.dry_run and _is_hub_id(name):
        return None
    try:
        return resolve_model_dir(name, args.model.use_hf, args.model.model_revision)
    except UserError as exc:
        if origin == "--model":
            raise
        raise UserError(f"{origin} names the base model {name}: {exc}; pass --model") from None


def _base(args: "ExportCommandArguments", adapter: Optional[AdapterSource],
          model_dir: Optional[str]) -> WeightsSource:
    """--mcore_model, else --model, else the base the adapter checkpoint holds or names."""
    if args.export.mcore_model:
        return mcore_source(args.export.mcore_model)
    if args.model.model:
        return WeightsSource("hf", model_dir or args.model.model, model_dir)
    if adapter.base is not None:
        return adapter.base
    if adapter.base_model:
        found = _resolve_hf(args, adapter.base_model, f"adapter {args.adapter}")
        return WeightsSource("hf", found or adapter.base_model, found)
    raise UserError(f"adapter {args.adapter} does not name its base model (no args.json, no "
                    "base_model_name_or_path): pass --model")


def _hf_files(args: "ExportCommandArguments", base: WeightsSource,
              model_dir: Optional[str]) -> Optional[str]:
    """The config.json + tokenizer directory: the base's own, else --model's, else (ms-swift) the
    model its args.json names."""
    if base.hf_files or base.kind == "hf":
        return base.hf_files
    if args.model.model:
        return model_dir
    if base.base_model:
        return _resolve_hf(args, base.base_model, f"--mcore_model {base.path} (args.json)")
    raise UserError(f"--mcore_model {base.path}: no config.json beside it and no args.json naming "
                    "its model: pass --model (the HF model it was trained from)")


def _model_description(args: "ExportCommandArguments", base: WeightsSource,
                       hf_files: Optional[str]):
    """(hf_config, model_type, source dtype) from config.json; Nones when not available."""
    if hf_files is None:
        return None, None, base.dtype
    from swift_megatron.bridge.io import HFReader  # heavy imports after the cheap path checks
    from swift_megatron.model.config import load_hf_config, model_shape

    hf_config = load_hf_config(hf_files)
    shape = model_shape(hf_config, model_type=args.model.model_type)
    if base.kind == "hf":
        HFReader(base.path)  # fails now when the directory holds no safetensors checkpoint
    return hf_config, shape.model_type, base.dtype or shape.torch_dtype


def _adapter_config(adapter: Optional[AdapterSource]) -> Optional["LoraConfig"]:
    if adapter is None:
        return None
    from swift_megatron.lora import read_adapter_config  # imports megatron-core: only when needed

    if adapter.peft_dir:
        return read_adapter_config(adapter.peft_dir)
    from swift_megatron.checkpoint import ms_swift_lora
    from swift_megatron.checkpoint.ms_swift import read_ms_swift_checkpoint
    from swift_megatron.lora.peft_io import config_from_peft

    checkpoint = read_ms_swift_checkpoint(adapter.ms_swift)
    config = ms_swift_lora.peft_config(checkpoint, ms_swift_lora.adapter_keys(checkpoint))
    return config_from_peft(config, f"{adapter.ms_swift}/args.json")


def _output(args: "ExportCommandArguments", adapter: Optional[AdapterSource]) -> Optional[str]:
    e = args.export
    if e.to_mcore:
        return "mcore"
    if e.to_hf:
        return "peft" if adapter is not None and not e.merge_lora else "hf"
    return "hf" if e.merge_lora else None


def _reference(args: "ExportCommandArguments", base: WeightsSource, adapter, output,
               model_dir: Optional[str]) -> Optional[str]:
    """The HF weights the precision check compares with, before anything is written (for an HF
    output it is the output itself): the base's own, --model's, or the model it names."""
    if not args.export.test_convert_precision or output == "hf":
        return None
    if base.kind == "hf":
        return base.hf_files or base.path
    if model_dir or args.model.model:
        return model_dir or args.model.model
    name = base.base_model or (adapter.base_model if adapter else None)
    if name:
        return _resolve_hf(args, name, f"{base.describe()} (args.json)") or name
    raise UserError("--test_convert_precision true compares with an HF checkpoint of the model: "
                    "pass --model")


def _check_world(args: "ExportCommandArguments", world_size: int) -> None:
    p = args.parallel
    for name, degree in (("TP x PP", p.tensor_model_parallel_size * p.pipeline_model_parallel_size),
                         ("ETP x EP x PP", p.expert_tensor_parallel_size
                          * p.expert_model_parallel_size * p.pipeline_model_parallel_size)):
        if world_size % degree:
            raise UserError(f"{name} = {degree} needs a multiple of {degree} processes, this run "
                            f"has {world_size}: launch with NPROC_PER_NODE={degree}")


def _check_model(args: "ExportCommandArguments", inputs: "ExportInputs") -> None:
    from swift_megatron.model.config import DTYPES
    from swift_megatron.parallel.layout import check_layout

    if inputs.dtype is not None and inputs.dtype not in DTYPES:
        raise UserError(f"weights dtype {inputs.dtype!r} is not supported; pass --torch_dtype "
                        f"({', '.join(DTYPES)})")
    if inputs.hf_config is not None:
        p = args.parallel
        check_layout(inputs.hf_config, p.tensor_model_parallel_size,
                     p.pipeline_model_parallel_size, p.expert_model_parallel_size,
                     p.expert_tensor_parallel_size)


def _check_output(args: "ExportCommandArguments", inputs: ExportInputs) -> None:
    from swift_megatron.bridge.hf_checkpoint import check_output_dir

    e = args.export
    if inputs.output is None:
        return
    check_output_dir(e.output_dir, e.exist_ok)
    out = os.path.realpath(e.output_dir)
    adapter = inputs.adapter.path if inputs.adapter else None
    for source in (inputs.base.path, inputs.hf_files, adapter):
        if source and out == os.path.realpath(source):
            raise UserError(f"--output_dir {e.output_dir} is an input directory; choose another")


def prepare(args: "ExportCommandArguments", world_size: int) -> ExportInputs:
    """Resolve and check everything a user can get wrong, before any model is built: the input
    checkpoints, the model family, the adapter's config, the output directory, the parallel
    layout and world size. Reads no weights; downloads a hub id unless --dry_run."""
    flag = "--adapters" if args.lora.adapters else "--mcore_adapter"
    adapter = adapter_source(args.adapter, flag) if args.adapter else None
    model_dir = _resolve_hf(args, args.model.model, "--model") if args.model.model else None
    if model_dir and args.model.check_model:
        from swift_megatron.model.files import check_model_dir

        check_model_dir(model_dir)
    base = _base(args, adapter, model_dir)
    hf_files = _hf_files(args, base, model_dir)
    hf_config, model_type, source_dtype = _model_description(args, base, hf_files)
    output = _output(args, adapter)
    inputs = ExportInputs(
        base=base, hf_files=hf_files, hf_config=hf_config, model_type=model_type,
        source_dtype=source_dtype, dtype=args.model.torch_dtype or source_dtype,
        base_name=args.model.model or base.base_model or (adapter and adapter.base_model)
        or base.path, adapter=adapter,
        lora=_adapter_config(adapter),
        merge=bool(adapter and args.export.merge_lora), output=output,
        reference=_reference(args, base, adapter, output, model_dir), model_dir=model_dir)
    _check_model(args, inputs)
    _check_world(args, world_size)
    _check_output(args, inputs)
    return inputs


def _adapter_line(inputs: ExportInputs) -> str:
    lora = inputs.lora
    what = {"mcore": "kept beside the weights (a LoRA checkpoint)", "hf": "merged",
            "peft": "written alone in PEFT format", None: "applied"}[inputs.output]
    if inputs.merge and inputs.output == "mcore":
        what = "merged"
    return (f"{inputs.adapter.describe()} (r={lora.r}, alpha={lora.lora_alpha:g}, "
            f"{', '.join(lora.projections())}): {what}")


def describe(args: "ExportCommandArguments", inputs: ExportInputs, world_size: int) -> str:
    """The plan of the command (--dry_run): what it reads, writes and checks, in which layout."""
    e, p = args.export, args.parallel
    unknown = "not checked (a hub id: downloaded at run time)"
    model = f"{inputs.model_type}, {inputs.source_dtype}" if inputs.hf_config else unknown
    rows = ["megatron export --dry_run: nothing was loaded, downloaded or written",
            f"  base weights      {inputs.base.describe()} ({model})",
            f"  config/tokenizer  {inputs.hf_files or unknown}"]
    if inputs.adapter:
        rows.append(f"  adapter           {_adapter_line(inputs)}")
    if inputs.output:
        replace = " (replacing it: --exist_ok true)" if os.path.exists(e.output_dir) else ""
        rows.append(f"  writes            {OUTPUTS[inputs.output]} ({inputs.dtype or 'source dtype'})"
                    f" at {e.output_dir}{replace}")
    dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    rows.append(f"  layout            TP={p.tensor_model_parallel_size} "
                f"PP={p.pipeline_model_parallel_size} EP={p.expert_model_parallel_size} "
                f"ETP={p.expert_tensor_parallel_size} on {world_size} process(es) (DP={dp})")
    if e.test_convert_precision:
        reference = e.output_dir if inputs.output == "hf" else inputs.reference
        rows.append(f"  precision check   {e.test_convert_dtype} logits vs transformers on "
                    f"{reference}, atol {e.test_convert_precision_atol:g}")
    return "\n".join(rows)


# ---- models ---------------------------------------------------------------------------------

@dataclasses.dataclass
class LoadedModel:
    """This rank's GPTModel (its pipeline stage) with the bridge and shape that describe it."""

    model: "torch.nn.Module"
    bridge: "Bridge"
    shape: "ModelShape"
    dtype: "torch.dtype"


def _weights(hf_dir: Optional[str], mcore_dir: Optional[str]) -> WeightsSource:
    from swift_megatron.checkpoint.ms_swift import is_ms_swift_checkpoint

    if hf_dir is not None:
        return WeightsSource("hf", hf_dir)
    return WeightsSource("ms_swift" if is_ms_swift_checkpoint(mcore_dir) else "mcore", mcore_dir)


def load_mcore_model(hf_config: dict, model_type: str, dtype: "torch.dtype",
                     state: "ParallelState", *, hf_dir: Optional[str] = None,
                     mcore_dir: Optional[str] = None, adapter_dir: Optional[str] = None,
                     sequence_parallel: bool = False) -> LoadedModel:
    """Build the model of the current layout (with sequence parallelism when asked) and load it
    from an HF checkpoint (through the bridge) or from a Megatron checkpoint (our model directory
    or an ms-swift checkpoint, any layout); with `adapter_dir`, a PEFT adapter on top.
    Collective."""
    from swift_megatron.bridge import Bridge
    from swift_megatron.model.build import build_model

    if (hf_dir is None) == (mcore_dir is None):
        raise ValueError("load from exactly one of hf_dir and mcore_dir")
    model, config, shape = build_model(hf_config, dtype, state.device, model_type=model_type,
                                       random_init=False, sequence_parallel=sequence_parallel)
    bridge = Bridge(hf_config, shape, config)
    load_weights([model], _weights(hf_dir, mcore_dir), bridge)
    if adapter_dir is not None:
        from swift_megatron.lora import load_adapter

        load_adapter(model, adapter_dir, bridge.mappings)
    return LoadedModel(model.eval(), bridge, shape, dtype)


def load_inputs(inputs: ExportInputs, dtype: "torch.dtype", state: "ParallelState") -> LoadedModel:
    """The base model of the command, with its adapter when there is one. Collective."""
    source = {"hf_dir" if inputs.base.kind == "hf" else "mcore_dir": inputs.base.path}
    adapter = inputs.adapter.peft_dir if inputs.adapter else None
    return load_mcore_model(inputs.hf_config, inputs.model_type, dtype, state,
                            adapter_dir=adapter, **source)


def _broadcast_object(value, src: int = 0):
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def _publish(tmp: str, out_dir: str, state: "ParallelState") -> None:
    """Rename a completely written `tmp` to `out_dir` (replacing it) on rank 0. Collective."""
    state.barrier()
    if state.rank == 0:
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    state.barrier()


def _tmp_name(out_dir: str) -> str:
    """Rank 0's staging directory for `out_dir` (after removing those dead runs left)."""
    from swift_megatron.paths import staging_dir, sweep_stale

    if int(os.environ.get("RANK", "0")) == 0:
        sweep_stale(out_dir)
    return _broadcast_object(staging_dir(out_dir))


@contextlib.contextmanager
def _staged(out_dir: str, state: "ParallelState"):
    """Yield the staging directory of `out_dir`, publish it when the body succeeds, remove it
    when it fails (rank 0). Collective."""
    tmp = _tmp_name(out_dir)
    try:
        yield tmp
    except BaseException:
        if state.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, os.path.abspath(out_dir), state)


def save_model_dir(loaded: LoadedModel, out_dir: str, hf_source_dir: str,
                   state: "ParallelState", *, lora: Optional["LoraConfig"] = None,
                   base_name: Optional[str] = None) -> None:
    """Write a Megatron model directory (weights, HF config and tokenizer, meta) under a temporary
    name and rename it into place, replacing `out_dir`. With `lora` (a model carrying adapters),
    also its adapter in PEFT format under adapter/: a LoRA checkpoint. Collective."""
    from swift_megatron.bridge.hf_checkpoint import DTYPE_NAMES
    from swift_megatron.checkpoint.layout import write_model_dir
    from swift_megatron.checkpoint.sources import OUR_ADAPTER
    from swift_megatron.lora import save_adapter

    meta = {"model_type": loaded.shape.model_type, "dtype": DTYPE_NAMES[loaded.dtype],
            "saved_with": {"tp": state.tp, "pp": state.pp, "ep": state.ep, "etp": state.etp}}
    with _staged(out_dir, state) as tmp:
        write_model_dir([loaded.model], tmp, hf_source_dir=hf_source_dir, meta=meta)
        if lora is not None:
            save_adapter(loaded.model, os.path.join(tmp, OUR_ADAPTER), base_name, lora)


def save_peft_dir(loaded: LoadedModel, out_dir: str, base_name: str, lora: "LoraConfig",
                  state: "ParallelState") -> None:
    """Write the model's adapter as a PEFT directory, atomically (replacing `out_dir`)."""
    from swift_megatron.lora import save_adapter

    with _staged(out_dir, state) as tmp:
        save_adapter(loaded.model, tmp, base_name, lora)


def write_output(args: "ExportCommandArguments", inputs: ExportInputs,
                 state: "ParallelState") -> None:
    """Load the base (+ adapter) and write what the command asks for. Megatron and PEFT outputs
    are loaded in the written dtype; an HF output is loaded in the source dtype (when supported)
    and converted by the bridge while writing. Collective."""
    from swift_megatron.lora import merge_and_unload
    from swift_megatron.model.config import DTYPES

    e, start = args.export, time.perf_counter()
    hf_from_source = inputs.output == "hf" and inputs.source_dtype in DTYPES
    load_dtype = inputs.source_dtype if hf_from_source else inputs.dtype
    loaded = load_inputs(inputs, DTYPES[load_dtype], state)
    if inputs.output == "mcore":
        if inputs.merge:
            merge_and_unload(loaded.model)
        kept = inputs.lora if inputs.adapter and not inputs.merge else None
        save_model_dir(loaded, e.output_dir, inputs.hf_files, state, lora=kept,
                       base_name=inputs.base_name)
    elif inputs.output == "peft":
        save_peft_dir(loaded, e.output_dir, inputs.base_name, inputs.lora, state)
    else:
        loaded.bridge.save_hf(loaded.model, e.output_dir, source_dir=inputs.hf_files,
                              dtype=DTYPES[inputs.dtype], max_shard_size=e.max_shard_size,
                              exist_ok=e.exist_ok,
                              passthrough_dir=inputs.base.hf_files if inputs.base.kind == "hf"
                              else inputs.model_dir)
    logger.info(f"wrote {OUTPUTS[inputs.output]} {e.output_dir} ({inputs.model_type}, "
                f"{inputs.dtype}, TP={state.tp} PP={state.pp} EP={state.ep} ETP={state.etp}) in "
                f"{time.perf_counter() - start:.1f} s")


# ---- precision ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Megatron vs transformers logits on the same tokens (real vocabulary only)."""

    max_abs_diff: float
    mean_abs_diff: float
    argmax_agreement: float   # fraction of positions whose top token agrees
    max_abs_logit: float      # the largest |HF logit|: the scale the differences compare with
    num_tokens: int
    dtype: str

    def table(self, atol: Optional[float] = None) -> str:
        rows = [f"precision check: Megatron vs transformers, {self.dtype}, {self.num_tokens} "
                "random tokens",
                f"  max abs logit diff   {self.max_abs_diff:.3e}",
                f"  mean abs logit diff  {self.mean_abs_diff:.3e}",
                f"  argmax agreement     {self.argmax_agreement:.4f}",
                f"  largest |logit|      {self.max_abs_logit:.3e}"]
        if atol is not None:
            verdict = "PASS" if self.max_abs_diff <= atol else "FAIL"
            rows.append(f"  atol                 {atol:.1e}  -> {verdict}")
        return "\n".join(rows)


def random_tokens(vocab_size: int, max_positions: int, device,
                  sequences: int = PRECISION_SEQUENCES, length: int = PRECISION_LENGTH,
                  seed: int = PRECISION_SEED) -> "torch.Tensor":
    """Seeded random token ids [sequences, length] (the same on every rank)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (sequences, min(length, max_positions))
    return torch.randint(0, vocab_size, shape, generator=generator).to(device)


def _gathered_logits(vocab_size: int, micro_batch: dict, output):
    """forward_backward loss callback: full-vocab float32 logits as the micro-batch's metric."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = output.logits()
    full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size].float()
    return logits.new_zeros(()), {"logits": full}


def mcore_logits(loaded: LoadedModel, tokens: "torch.Tensor", state: "ParallelState",
                 extra: Optional[dict] = None) -> "torch.Tensor":
    """float32 logits [b, s, vocab_size] of the Megatron model on every rank: one forward-only
    pass through megatron's (pipelined) schedule, gathered over TP, broadcast from the last
    pipeline stage. `extra`: micro-batch entries besides the tokens and 1-D positions (a
    vision-language model's images and 3-D positions). Collective."""
    import functools

    import torch
    import torch.distributed as dist

    from swift_megatron.training.step import forward_backward

    vocab = loaded.shape.vocab_size
    batch = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1], device=tokens.device)
             .expand_as(tokens).contiguous(), **(extra or {})}
    with torch.no_grad():
        outputs = forward_backward([loaded.model], [batch],
                                   functools.partial(_gathered_logits, vocab), forward_only=True)
    if state.is_last_stage:
        logits = outputs[0]["logits"].contiguous()
    else:
        logits = torch.empty(*tokens.shape, vocab, dtype=torch.float32, device=tokens.device)
    if state.pp > 1:
        dist.broadcast(logits, src=state.last_stage_rank(), group=state.pp_group)
    return logits


def _from_pretrained_dtype_kwarg() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def round_weights(module: "torch.nn.Module", dtype: Optional["torch.dtype"]) -> None:
    """Round every parameter to `dtype` and back, in place: the values a `dtype` checkpoint of
    the same weights holds (no-op for None or a dtype the parameters already have)."""
    import torch

    if dtype is None:
        return
    with torch.no_grad():
        for param in module.parameters():
            if param.dtype != dtype:
                param.copy_(param.to(dtype))


def hf_logits(hf_dir: str, tokens: "torch.Tensor", dtype: "torch.dtype",
              weights_dtype: Optional["torch.dtype"] = None,
              adapter_dir: Optional[str] = None, images: Optional[dict] = None) -> "torch.Tensor":
    """float32 logits [b, s, vocab] of the transformers model of `hf_dir` (with the PEFT adapter
    `adapter_dir` applied by peft, when given), run in `dtype` on the device of `tokens` (its
    weights first rounded to `weights_dtype`, when given). `images`: the image keywords of a
    vision-language model (then its whole image-text-to-text model runs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir, **{_from_pretrained_dtype_kwarg(): dtype})
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir, autocast_adapter_dtype=False)
    model = model.to(tokens.device).eval()
    round_weights(model, weights_dtype)
    with torch.no_grad():
        logits = model(input_ids=tokens, **(images or {})).logits.float()
    del model
    return logits


def compare_logits(mcore: "torch.Tensor", hf: "torch.Tensor", dtype_name: str) -> PrecisionReport:
    """The report of two float32 logits tensors [b, s, vocab] (`hf` is the reference)."""
    if mcore.shape != hf.shape:
        raise ValueError(f"logits shapes differ: Megatron {tuple(mcore.shape)}, "
                         f"HF {tuple(hf.shape)}")
    diff = (mcore - hf).abs()
    agree = (mcore.argmax(-1) == hf.argmax(-1)).float().mean()
    return PrecisionReport(max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
                           argmax_agreement=agree.item(), max_abs_logit=hf.abs().max().item(),
                           num_tokens=mcore.shape[0] * mcore.shape[1], dtype=dtype_name)


def measure_precision(loaded: LoadedModel, hf_dir: str, state: "ParallelState",
                      weights_dtype: Optional["torch.dtype"] = None,
                      adapter_dir: Optional[str] = None,
                      length: int = PRECISION_LENGTH) -> PrecisionReport:
    """Run the loaded Megatron model and the transformers model of `hf_dir` (+ the PEFT adapter
    `adapter_dir`), in the Megatron model's dtype, on the same random tokens (`length` per
    sequence; a vision-language model's with an image in each sequence: precision_images.py).
    With `weights_dtype` both models' weights are first
    rounded to it (the Megatron model's in place), so that a conversion that also changes the
    dtype is measured on equal weights. The transformers model runs on global rank 0 only; the
    report is returned on every rank. Collective."""
    from swift_megatron.bridge.hf_checkpoint import DTYPE_NAMES
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.model.vision import takes_images
    from swift_megatron.precision_images import ImageInputs, image_inputs

    round_weights(loaded.model, weights_dtype)
    tokens = random_tokens(loaded.shape.vocab_size, loaded.shape.max_position_embeddings,
                           state.device, length=length)
    inputs = ImageInputs(tokens, {}, {})
    hf_config = load_hf_config(hf_dir)
    if takes_images(hf_dir, hf_config):   # Qwen3.5 without an image processor: text only
        inputs = image_inputs(hf_dir, hf_config, tokens)
    mcore = mcore_logits(loaded, inputs.tokens, state, inputs.mcore)
    label = DTYPE_NAMES[loaded.dtype]
    if weights_dtype not in (None, loaded.dtype):
        label += f" ({DTYPE_NAMES[weights_dtype]} weights)"
    if inputs.hf:
        label += ", an image in each sequence"
    report = None
    if state.rank == 0:
        reference = hf_logits(hf_dir, inputs.tokens, loaded.dtype, weights_dtype, adapter_dir,
                              inputs.hf)
        report = compare_logits(mcore, reference, label)
    return _broadcast_object(report)


def check_precision(report: PrecisionReport, atol: float) -> None:
    """Log the report's table; UserError when the max abs difference exceeds `atol`."""
    logger.info(report.table(atol))
    if report.max_abs_diff > atol:
        raise UserError(f"precision check failed: max abs logit diff {report.max_abs_diff:.3e} > "
                        f"--test_convert_precision_atol {atol:g} (mean {report.mean_abs_diff:.3e}, "
                        f"argmax agreement {report.argmax_agreement:.4f})")


def _precision_sides(args: "ExportCommandArguments", inputs: ExportInputs):
    """(Megatron source as load_mcore_model keywords, HF reference dir, reference adapter dir):
    the Megatron side is what --to_mcore wrote or else the inputs; the HF side is what --to_hf
    wrote or else the reference weights, with the adapter applied by peft."""
    e = args.export
    adapter = inputs.adapter.peft_dir if inputs.adapter else None
    if inputs.output == "mcore":
        from swift_megatron.checkpoint.sources import OUR_ADAPTER

        kept = os.path.join(e.output_dir, OUR_ADAPTER) if adapter and not inputs.merge else None
        return {"mcore_dir": e.output_dir, "adapter_dir": kept}, inputs.reference, adapter
    source = {"hf_dir" if inputs.base.kind == "hf" else "mcore_dir": inputs.base.path,
              "adapter_dir": adapter}
    if inputs.output == "hf":
        return source, e.output_dir, None
    return source, inputs.reference, e.output_dir if inputs.output == "peft" else adapter


def _run_precision(args: "ExportCommandArguments", inputs: ExportInputs,
                   state: "ParallelState") -> None:
    """The precision check of the command, in --test_convert_dtype. Both sides use weights of
    the dtype the conversion writes, so that only the conversion is measured."""
    from swift_megatron.model.config import DTYPES

    e = args.export
    source, reference, adapter = _precision_sides(args, inputs)
    loaded = load_mcore_model(inputs.hf_config, inputs.model_type, DTYPES[e.test_convert_dtype],
                              state, **source)
    report = measure_precision(loaded, reference, state, weights_dtype=DTYPES[inputs.dtype],
                               adapter_dir=adapter)
    check_precision(report, e.test_convert_precision_atol)


# ---- the command ----------------------------------------------------------------------------

def _as_peft(inputs: ExportInputs, tmp_dir: str) -> ExportInputs:
    """The inputs with an ms-swift adapter kept in its distributed checkpoint converted into a
    PEFT directory under `tmp_dir` (each process its own: no shared file system needed)."""
    if inputs.adapter is None or inputs.adapter.peft_dir:
        return inputs
    from swift_megatron.checkpoint.sources import peft_dir_of

    peft_dir = peft_dir_of(inputs.adapter, inputs.hf_config, tmp_dir)
    return dataclasses.replace(inputs, adapter=dataclasses.replace(inputs.adapter,
                                                                   peft_dir=peft_dir))


def run(args: "ExportCommandArguments", inputs: ExportInputs) -> None:
    """Write and check what `args` ask for, in this process's share of the layout."""
    import tempfile

    from swift_megatron.parallel.state import ParallelState

    p = args.parallel
    state = ParallelState.initialize(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
        device=args.model.device)
    try:
        with tempfile.TemporaryDirectory(prefix="swift_megatron_export_") as tmp_dir:
            inputs = _as_peft(inputs, tmp_dir)
            if inputs.output:
                write_output(args, inputs, state)
            if args.export.test_convert_precision:
                _run_precision(args, inputs, state)
    finally:
        ParallelState.destroy()
