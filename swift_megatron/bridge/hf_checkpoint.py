"""Write an HF checkpoint directory from a stream of (name, tensor) pairs: sharded safetensors
with index json, config.json (dtype updated), generation_config.json and tokenizer files copied
from the source model. Written under a temporary name and renamed when complete (a failed write
removes it; a full disk is a WriteFailed naming the cause: paths.py); only global rank 0 writes,
but every rank must drain the stream (exporting is collective). Tensors of the source checkpoint
under the `passthrough` prefixes (parts the Megatron model does not hold, as Qwen3.5's vision
tower) are copied into the output unchanged, in their own dtype."""
import json
import os
import shutil
from typing import Iterable, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from swift_megatron.bridge.io import INDEX, SINGLE, HFReader, HFWriter
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.logging.progress import progress
from swift_megatron.paths import (check_output_path, kept_as_before, removed_if_failed,
                                  staging_dir, sweep_stale)

logger = get_logger(__name__)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_output_dir(out_dir: str, exist_ok: bool) -> None:
    check_output_path(out_dir, "--output_dir")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not exist_ok:
        raise UserError(f"{out_dir} exists and is not empty; pass --exist_ok true to overwrite it")


def copy_model_files(source_dir: str, out_dir: str) -> None:
    """Copy config, generation config and tokenizer files (everything but weights)."""
    for name in os.listdir(source_dir):
        path = os.path.join(source_dir, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES) \
                and name != "model.safetensors.index.json":
            shutil.copy2(path, os.path.join(out_dir, name))


def passthrough_tensors(source_dir: str, prefixes: Sequence[str]
                        ) -> Iterator[Tuple[str, torch.Tensor]]:
    """The source checkpoint's tensors whose names start with one of `prefixes` (none when the
    source directory holds no safetensors weights)."""
    if not prefixes:
        return
    if not any(os.path.isfile(os.path.join(source_dir, n)) for n in (SINGLE, INDEX)):
        logger.warning(f"{source_dir} holds no safetensors weights: the exported checkpoint lacks "
                       f"its tensors under {', '.join(prefixes)}")
        return
    reader = HFReader(source_dir)
    for name in sorted(reader.file_of):
        if name.startswith(tuple(prefixes)):
            yield name, reader.read(name)


def _write_config(out_dir: str, hf_config: dict, dtype: torch.dtype) -> None:
    config = dict(hf_config)
    name = DTYPE_NAMES[dtype]
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_hf_checkpoint(pairs: Iterable[Tuple[str, torch.Tensor]], out_dir: str, *,
                        hf_config: dict, source_dir: str, dtype: Optional[torch.dtype] = None,
                        max_shard_size: str = "5GB", exist_ok: bool = False,
                        total: Optional[int] = None, passthrough: Sequence[str] = (),
                        passthrough_dir: Optional[str] = None) -> None:
    writer_rank = not dist.is_initialized() or dist.get_rank() == 0
    out_dir = os.path.abspath(out_dir)
    tmp = staging_dir(out_dir)
    if writer_rank:
        check_output_dir(out_dir, exist_ok)
        sweep_stale(out_dir)   # what a killed export or save staged here
    with removed_if_failed(tmp, out_dir, kept_as_before(out_dir), remove=writer_rank):
        writer = HFWriter(tmp, max_shard_size) if writer_rank else None
        if writer:
            os.makedirs(tmp, exist_ok=True)
        written_dtype = dtype
        for name, tensor in progress(pairs, desc="exporting HF weights", total=total):
            written_dtype = written_dtype or tensor.dtype
            if writer:
                writer.add(name, tensor.to(written_dtype))
        if writer:
            _finish(writer, tmp, out_dir, source_dir=source_dir, hf_config=hf_config,
                    dtype=written_dtype, passthrough=(passthrough_dir or source_dir, passthrough))


def _finish(writer: HFWriter, tmp: str, out_dir: str, *, source_dir: str, hf_config: dict,
            dtype: torch.dtype, passthrough: Tuple[str, Sequence[str]]) -> None:
    """The passthrough tensors, last shard, config and tokenizer files; then publish `tmp`."""
    for name, tensor in passthrough_tensors(*passthrough):
        writer.add(name, tensor)
    writer.close()
    copy_model_files(source_dir, tmp)
    _write_config(tmp, hf_config, dtype)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    logger.info(f"wrote HF checkpoint {out_dir} ({writer.total_bytes / 1e6:.1f} MB)")
