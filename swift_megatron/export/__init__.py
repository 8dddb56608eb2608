"""`megatron export`: convert checkpoints between Hugging Face and Megatron-core, apply or merge
LoRA adapters, and measure how closely the Megatron model reproduces the Hugging Face one.

This package sits beside bridge/ and imports it (and checkpoint/, lora/, model/, training/'s
forward schedule); nothing below imports it. A command names a base model, optionally an
adapter, and what to write (ms-swift's forms and ours; docs/export.md has the table):

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
process is launched or model built; `describe` prints its result for --dry_run) and `run`.

    inputs.py           ExportInputs and `prepare`
    plan.py             `describe`: the --dry_run plan
    convert.py          `run`: load, write the output form, check precision
    peft_forms.py       a Megatron model directory (with a kept adapter), a PEFT directory, an
                        ms-swift adapter converted to PEFT
    staging.py          outputs written under a temporary name and renamed when complete
    merge.py            `merge_adapter_into_hf`: PEFT adapter + HF base -> merged HF checkpoint
    logits.py           both sides' logits on the same random tokens
    precision.py        the comparison, its report and the command's check
    precision_images.py a vision-language model's check inputs: an image in each sequence

Loading a Megatron model to run (`load_mcore_model`, `LoadedModel`) lives in
checkpoint/loaded_model.py, shared with the tests and benchmarks. Every function that touches a
Megatron model is collective: call it on every rank. torch, megatron and transformers are
imported inside the functions, so that `prepare` can reject a missing path at once.
"""
from swift_megatron.export.convert import load_inputs, run, write_output
from swift_megatron.export.inputs import ExportInputs, prepare
from swift_megatron.export.logits import hf_logits, mcore_logits, random_tokens, round_weights
from swift_megatron.export.merge import merge_adapter_into_hf
from swift_megatron.export.peft_forms import save_model_dir, save_peft_dir
from swift_megatron.export.plan import OUTPUTS, describe
from swift_megatron.export.precision import (PrecisionReport, check_precision, compare_logits,
                                             measure_precision)

__all__ = ["ExportInputs", "OUTPUTS", "PrecisionReport", "check_precision", "compare_logits",
           "describe", "hf_logits", "load_inputs", "mcore_logits", "measure_precision",
           "merge_adapter_into_hf", "prepare", "random_tokens", "round_weights", "run",
           "save_model_dir", "save_peft_dir", "write_output"]
