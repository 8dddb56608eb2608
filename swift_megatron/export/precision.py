"""The precision check of `megatron export --test_convert_precision`: the Megatron model and
transformers on the same random tokens (logits.py; for a vision-language model with an image
in each sequence, precision_images.py), compared as max / mean absolute logit difference and
argmax agreement, and failed past an absolute tolerance. `run_precision` checks what the command
wrote (or, alone, the base + adapter) against the HF model (+ adapter, via peft).
"""
import dataclasses
import os
from typing import TYPE_CHECKING, Optional

from swift_megatron.checkpoint.loaded_model import LoadedModel, load_mcore_model
from swift_megatron.checkpoint.sources import OUR_ADAPTER
from swift_megatron.errors import UserError
from swift_megatron.export.inputs import ExportInputs
from swift_megatron.export.logits import (PRECISION_LENGTH, hf_logits, mcore_logits, random_tokens,
                                          round_weights)
from swift_megatron.export.staging import broadcast_object
from swift_megatron.logging import get_logger

if TYPE_CHECKING:
    import torch

    from swift_megatron.arguments.commands import ExportCommandArguments
    from swift_megatron.parallel.state import ParallelState

logger = get_logger(__name__)


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


def _label(loaded: LoadedModel, weights_dtype: Optional["torch.dtype"], images: bool) -> str:
    """The report's description of what ran: the dtype, the weights' dtype, images."""
    from swift_megatron.bridge.hf_checkpoint import DTYPE_NAMES

    label = DTYPE_NAMES[loaded.dtype]
    if weights_dtype not in (None, loaded.dtype):
        label += f" ({DTYPE_NAMES[weights_dtype]} weights)"
    return label + (", an image in each sequence" if images else "")


def _inputs(loaded: LoadedModel, hf_dir: str, state: "ParallelState", length: int):
    """The random tokens of the check, with an image in each sequence for a vision-language
    model (precision_images.py)."""
    from swift_megatron.export.precision_images import ImageInputs, image_inputs
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.model.vision import takes_images

    tokens = random_tokens(loaded.shape.vocab_size, loaded.shape.max_position_embeddings,
                           state.device, length=length)
    hf_config = load_hf_config(hf_dir)
    if takes_images(hf_dir, hf_config):   # Qwen3.5 without an image processor: text only
        return image_inputs(hf_dir, hf_config, tokens)
    return ImageInputs(tokens, {}, {})


def measure_precision(loaded: LoadedModel, hf_dir: str, state: "ParallelState",
                      weights_dtype: Optional["torch.dtype"] = None,
                      adapter_dir: Optional[str] = None,
                      length: int = PRECISION_LENGTH) -> PrecisionReport:
    """Run the loaded Megatron model and the transformers model of `hf_dir` (+ the PEFT adapter
    `adapter_dir`), in the Megatron model's dtype, on the same random tokens (`length` per
    sequence; a vision-language model's with an image in each sequence: precision_images.py).
    With `weights_dtype` both models' weights are first rounded to it (the Megatron model's in
    place), so that a conversion that also changes the dtype is measured on equal weights. The
    transformers model runs on global rank 0 only; the report is returned on every rank.
    Collective."""
    round_weights(loaded.model, weights_dtype)
    inputs = _inputs(loaded, hf_dir, state, length)
    mcore = mcore_logits(loaded, inputs.tokens, state, inputs.mcore)
    report = None
    if state.rank == 0:
        reference = hf_logits(hf_dir, inputs.tokens, loaded.dtype, weights_dtype, adapter_dir,
                              inputs.hf)
        report = compare_logits(mcore, reference, _label(loaded, weights_dtype, bool(inputs.hf)))
    return broadcast_object(report)


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
        kept = os.path.join(e.output_dir, OUR_ADAPTER) if adapter and not inputs.merge else None
        return {"mcore_dir": e.output_dir, "adapter_dir": kept}, inputs.reference, adapter
    source = {"hf_dir" if inputs.base.kind == "hf" else "mcore_dir": inputs.base.path,
              "adapter_dir": adapter}
    if inputs.output == "hf":
        return source, e.output_dir, None
    return source, inputs.reference, e.output_dir if inputs.output == "peft" else adapter


def run_precision(args: "ExportCommandArguments", inputs: ExportInputs,
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
