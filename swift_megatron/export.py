"""`megatron export`: convert checkpoints between Hugging Face and Megatron-core, and measure how
closely the Megatron model reproduces the Hugging Face one.

    --to_mcore true   HF directory (--model) -> Megatron model directory (checkpoint/layout.py),
                      loaded in the TP/PP/EP layout of the parallel flags
    --to_hf true      Megatron model directory (--mcore_model) -> HF checkpoint (Bridge.save_hf)
    --test_convert_precision true
                      transformers and Megatron in float32 on the same random tokens: max / mean
                      absolute logit difference and argmax agreement; fails past
                      --test_convert_precision_atol. Alone it loads --model through the bridge;
                      with --to_mcore it checks the written model directory against --model; with
                      --to_hf it checks the written HF checkpoint against --mcore_model.

cli/export.py parses the flags, calls `prepare` (every check a user can fail, before any
process is launched or model built) and `run`. The other public functions are the building
blocks tests and benchmarks reuse: `load_mcore_model`, `save_model_dir`, `convert_hf_to_mcore`,
`convert_mcore_to_hf`, `random_tokens`, `mcore_logits`, `hf_logits`, `round_weights`,
`compare_logits`, `measure_precision`, `check_precision`. Every function that touches a
Megatron model is collective: call it on every rank. torch, megatron and transformers are
imported inside the functions, so that `prepare` can reject a missing path at once.
"""
import dataclasses
import os
import shutil
import time
from typing import TYPE_CHECKING, Optional

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


# ---- inputs ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ExportInputs:
    """What `prepare` resolved: the directories a command reads and the model they hold."""

    hf_dir: Optional[str]     # HF checkpoint (--model), resolved to a local directory
    mcore_dir: Optional[str]  # Megatron model directory (--mcore_model or --mcore_adapter)
    hf_config: dict
    model_type: str
    dtype: str                # dtype name of the converted weights
    lora: Optional["LoraConfig"] = None   # --mcore_adapter: the adapters inside mcore_dir
    adapter_dir: Optional[str] = None     # --adapters: the PEFT adapter merged onto hf_dir


def _check_world(args: "ExportCommandArguments", world_size: int) -> None:
    p = args.parallel
    for name, degree in (("TP x PP", p.tensor_model_parallel_size * p.pipeline_model_parallel_size),
                         ("ETP x EP x PP", p.expert_tensor_parallel_size
                          * p.expert_model_parallel_size * p.pipeline_model_parallel_size)):
        if world_size % degree:
            raise UserError(f"{name} = {degree} needs a multiple of {degree} processes, this run "
                            f"has {world_size}: launch with NPROC_PER_NODE={degree}")


def _check_output(args: "ExportCommandArguments", inputs: ExportInputs) -> None:
    from swift_megatron.bridge.hf_checkpoint import check_output_dir

    e = args.export
    if not (e.to_mcore or e.to_hf or e.merge_lora):
        return
    check_output_dir(e.output_dir, e.exist_ok)
    out = os.path.realpath(e.output_dir)
    for source in (inputs.hf_dir, inputs.mcore_dir):
        if source and out == os.path.realpath(source):
            raise UserError(f"--output_dir {e.output_dir} is the input directory; choose another")


def _hf_inputs(args: "ExportCommandArguments"):
    from swift_megatron.model.hub import resolve_model_dir

    m = args.model
    hf_dir = resolve_model_dir(m.model, m.use_hf, m.model_revision)
    if m.check_model:
        from swift_megatron.model.files import check_model_dir

        check_model_dir(hf_dir)
    from swift_megatron.bridge.io import HFReader  # heavy imports after the cheap path check
    from swift_megatron.model.config import load_hf_config, model_shape

    hf_config = load_hf_config(hf_dir)
    shape = model_shape(hf_config, model_type=m.model_type)
    HFReader(hf_dir)  # fails now when the directory holds no safetensors checkpoint
    return hf_dir, hf_config, shape.model_type, m.torch_dtype or shape.torch_dtype


def _mcore_inputs(args: "ExportCommandArguments"):
    flag = "--mcore_adapter" if args.export.mcore_adapter else "--mcore_model"
    directory = args.export.mcore_adapter or args.export.mcore_model
    if not os.path.isdir(directory):
        raise UserError(f"{flag} {directory}: no such directory")
    from swift_megatron.checkpoint.layout import hf_dir, read_meta  # heavy: after the path check
    from swift_megatron.model.config import load_hf_config, model_shape

    meta = read_meta(directory)
    hf_config = load_hf_config(hf_dir(directory))
    shape = model_shape(hf_config, model_type=meta.get("model_type"))
    return directory, hf_config, shape.model_type, args.model.torch_dtype or meta["dtype"]


def _adapter_inputs(args: "ExportCommandArguments", mcore_dir: Optional[str]):
    """(LoRA config of --mcore_adapter's adapters, --adapters' PEFT directory); reading the
    adapter's files fails now on a bad adapter, before anything is launched."""
    from swift_megatron.lora import read_adapter

    if mcore_dir is not None:
        adapter = os.path.join(mcore_dir, "adapter")
        if not os.path.isdir(adapter):
            raise UserError(f"--mcore_adapter {mcore_dir}: no adapter/ directory (is this a "
                            "checkpoint of a --train_type lora run?)")
        return read_adapter(adapter)[0], None
    read_adapter(args.lora.adapters[0])
    return None, args.lora.adapters[0]


def prepare(args: "ExportCommandArguments", world_size: int) -> ExportInputs:
    """Resolve and check everything a user can get wrong, before any model is built: the input
    directories, the output directory, the model family, the parallel layout and world size."""
    e = args.export
    if e.test_convert_precision and not (e.to_hf or args.model.model):
        raise UserError("--test_convert_precision true needs --model (the HF checkpoint to compare "
                        "against) or --to_hf true")
    hf_dir = mcore_dir = lora = adapter_dir = None
    if e.to_hf:
        mcore_dir, hf_config, model_type, dtype = _mcore_inputs(args)
    else:
        hf_dir, hf_config, model_type, dtype = _hf_inputs(args)
    if e.merge_lora:
        lora, adapter_dir = _adapter_inputs(args, mcore_dir)
    from swift_megatron.model.config import DTYPES
    from swift_megatron.parallel.layout import check_layout

    if dtype not in DTYPES:
        raise UserError(f"weights dtype {dtype!r} is not supported; pass --torch_dtype "
                        f"({', '.join(DTYPES)})")
    p = args.parallel
    check_layout(hf_config, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                 p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    _check_world(args, world_size)
    inputs = ExportInputs(hf_dir, mcore_dir, hf_config, model_type, dtype, lora, adapter_dir)
    _check_output(args, inputs)
    return inputs


# ---- models ---------------------------------------------------------------------------------

@dataclasses.dataclass
class LoadedModel:
    """This rank's GPTModel (its pipeline stage) with the bridge and shape that describe it."""

    model: "torch.nn.Module"
    bridge: "Bridge"
    shape: "ModelShape"
    dtype: "torch.dtype"


def load_mcore_model(hf_config: dict, model_type: str, dtype: "torch.dtype",
                     state: "ParallelState", *, hf_dir: Optional[str] = None,
                     mcore_dir: Optional[str] = None,
                     lora: Optional["LoraConfig"] = None) -> LoadedModel:
    """Build the model of the current layout and load it from an HF checkpoint (through the
    bridge) or from a Megatron model directory (any layout); with `lora`, the model carries those
    adapters (a LoRA training checkpoint holds them). Collective."""
    from swift_megatron.bridge import Bridge
    from swift_megatron.checkpoint.layout import load_model_dir
    from swift_megatron.model.build import build_model

    if (hf_dir is None) == (mcore_dir is None):
        raise ValueError("load from exactly one of hf_dir and mcore_dir")
    model, config, shape = build_model(hf_config, dtype, state.device, model_type=model_type,
                                       random_init=False)
    bridge = Bridge(hf_config, shape, config)
    if lora is not None:
        from swift_megatron.lora import apply_lora

        apply_lora(model, lora, bridge.mappings)
    if hf_dir is not None:
        bridge.load(model, hf_dir)
    else:
        load_model_dir([model], mcore_dir)
    return LoadedModel(model.eval(), bridge, shape, dtype)


def _broadcast_object(value, src: int = 0):
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def save_model_dir(loaded: LoadedModel, out_dir: str, hf_source_dir: str,
                   state: "ParallelState") -> None:
    """Write a Megatron model directory (weights, HF config and tokenizer, meta) under a temporary
    name and rename it into place, replacing `out_dir`. Collective."""
    from swift_megatron.bridge.hf_checkpoint import DTYPE_NAMES
    from swift_megatron.checkpoint.layout import write_model_dir

    out_dir = os.path.abspath(out_dir)
    tmp = _broadcast_object(f"{out_dir}.tmp-{os.getpid()}")
    meta = {"model_type": loaded.shape.model_type, "dtype": DTYPE_NAMES[loaded.dtype],
            "saved_with": {"tp": state.tp, "pp": state.pp, "ep": state.ep, "etp": state.etp}}
    write_model_dir([loaded.model], tmp, hf_source_dir=hf_source_dir, meta=meta)
    if state.rank == 0:
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    state.barrier()


def convert_hf_to_mcore(inputs: ExportInputs, out_dir: str, state: "ParallelState") -> None:
    """HF checkpoint -> Megatron model directory in the current layout. Collective."""
    from swift_megatron.model.config import DTYPES

    start = time.perf_counter()
    loaded = load_mcore_model(inputs.hf_config, inputs.model_type, DTYPES[inputs.dtype], state,
                              hf_dir=inputs.hf_dir)
    save_model_dir(loaded, out_dir, inputs.hf_dir, state)
    logger.info(f"wrote Megatron model directory {out_dir} ({inputs.model_type}, {inputs.dtype}, "
                f"TP={state.tp} PP={state.pp} EP={state.ep} ETP={state.etp}) in "
                f"{time.perf_counter() - start:.1f} s")


def convert_mcore_to_hf(inputs: ExportInputs, out_dir: str, state: "ParallelState", *,
                        max_shard_size: str = "5GB", exist_ok: bool = False) -> None:
    """Megatron model directory -> HF checkpoint in `inputs.dtype`. Collective."""
    from swift_megatron.checkpoint.layout import hf_dir, read_meta
    from swift_megatron.model.config import DTYPES

    start = time.perf_counter()
    saved_dtype = DTYPES[read_meta(inputs.mcore_dir)["dtype"]]
    loaded = load_mcore_model(inputs.hf_config, inputs.model_type, saved_dtype, state,
                              mcore_dir=inputs.mcore_dir, lora=inputs.lora)
    loaded.bridge.save_hf(loaded.model, out_dir, source_dir=hf_dir(inputs.mcore_dir),
                          dtype=DTYPES[inputs.dtype], max_shard_size=max_shard_size,
                          exist_ok=exist_ok)
    logger.info(f"exported {inputs.mcore_dir} to {out_dir} ({inputs.dtype}) in "
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


def _gathered_logits(vocab_size: int, micro_batch: dict, logits: "torch.Tensor"):
    """forward_backward loss callback: full-vocab float32 logits as the micro-batch's metric."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size].float()
    return logits.new_zeros(()), {"logits": full}


def mcore_logits(loaded: LoadedModel, tokens: "torch.Tensor",
                 state: "ParallelState") -> "torch.Tensor":
    """float32 logits [b, s, vocab_size] of the Megatron model on every rank: one forward-only
    pass through megatron's (pipelined) schedule, gathered over TP, broadcast from the last
    pipeline stage. Collective."""
    import functools

    import torch
    import torch.distributed as dist

    from swift_megatron.training.step import forward_backward

    vocab = loaded.shape.vocab_size
    batch = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1], device=tokens.device)
             .expand_as(tokens).contiguous()}
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
              weights_dtype: Optional["torch.dtype"] = None) -> "torch.Tensor":
    """float32 logits [b, s, vocab] of the transformers model of `hf_dir`, run in `dtype` on the
    device of `tokens` (its weights first rounded to `weights_dtype`, when given)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, **{_from_pretrained_dtype_kwarg(): dtype})
    model = model.to(tokens.device).eval()
    round_weights(model, weights_dtype)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
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
                      weights_dtype: Optional["torch.dtype"] = None) -> PrecisionReport:
    """Run the loaded Megatron model and the transformers model of `hf_dir`, in the Megatron
    model's dtype, on the same random tokens. With `weights_dtype` both models' weights are first
    rounded to it (the Megatron model's in place), so that a conversion that also changes the
    dtype is measured on equal weights. The transformers model runs on global rank 0 only; the
    report is returned on every rank. Collective."""
    from swift_megatron.bridge.hf_checkpoint import DTYPE_NAMES

    round_weights(loaded.model, weights_dtype)
    tokens = random_tokens(loaded.shape.vocab_size, loaded.shape.max_position_embeddings,
                           state.device)
    mcore = mcore_logits(loaded, tokens, state)
    label = DTYPE_NAMES[loaded.dtype]
    if weights_dtype not in (None, loaded.dtype):
        label += f" ({DTYPE_NAMES[weights_dtype]} weights)"
    report = None
    if state.rank == 0:
        reference = hf_logits(hf_dir, tokens, loaded.dtype, weights_dtype)
        report = compare_logits(mcore, reference, label)
    return _broadcast_object(report)


def check_precision(report: PrecisionReport, atol: float) -> None:
    """Log the report's table; UserError when the max abs difference exceeds `atol`."""
    logger.info(report.table(atol))
    if report.max_abs_diff > atol:
        raise UserError(f"precision check failed: max abs logit diff {report.max_abs_diff:.3e} > "
                        f"--test_convert_precision_atol {atol:g} (mean {report.mean_abs_diff:.3e}, "
                        f"argmax agreement {report.argmax_agreement:.4f})")


def _run_precision(args: "ExportCommandArguments", inputs: ExportInputs,
                   state: "ParallelState") -> None:
    """The precision check of the command, in float32: the Megatron side loaded from what this
    command wrote (--to_mcore), read (--to_hf) or from --model; the HF side from --model or what
    --to_hf wrote. Both use weights of the dtype the conversion writes, so that only the
    conversion is measured."""
    import torch

    from swift_megatron.model.config import DTYPES

    e = args.export
    if e.to_mcore:
        reference, source = inputs.hf_dir, {"mcore_dir": e.output_dir}
    elif e.to_hf:
        reference, source = e.output_dir, {"mcore_dir": inputs.mcore_dir}
    else:
        reference, source = inputs.hf_dir, {"hf_dir": inputs.hf_dir}
    loaded = load_mcore_model(inputs.hf_config, inputs.model_type, torch.float32, state, **source)
    report = measure_precision(loaded, reference, state, weights_dtype=DTYPES[inputs.dtype])
    check_precision(report, e.test_convert_precision_atol)


# ---- the command ----------------------------------------------------------------------------

def run(args: "ExportCommandArguments", inputs: ExportInputs) -> None:
    """Run the conversions and checks `args` ask for, in this process's share of the layout."""
    from swift_megatron.parallel.state import ParallelState

    p, e = args.parallel, args.export
    state = ParallelState.initialize(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
        device=args.model.device)
    try:
        if e.to_mcore:
            convert_hf_to_mcore(inputs, e.output_dir, state)
        if e.to_hf:
            convert_mcore_to_hf(inputs, e.output_dir, state, max_shard_size=e.max_shard_size,
                                exist_ok=e.exist_ok)
        if inputs.adapter_dir:
            from swift_megatron.lora import merge_adapter_into_hf
            from swift_megatron.model.config import DTYPES

            merge_adapter_into_hf(inputs.hf_dir, inputs.adapter_dir, e.output_dir, state,
                                  dtype=DTYPES[inputs.dtype], max_shard_size=e.max_shard_size,
                                  exist_ok=e.exist_ok)
        if e.test_convert_precision:
            _run_precision(args, inputs, state)
    finally:
        ParallelState.destroy()
