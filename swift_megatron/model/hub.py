"""Resolve `--model` to a local directory: a local path as is, a hub id downloaded from
ModelScope (default, as ms-swift) or Hugging Face (`--use_hf true`). On each node local rank 0
downloads first and the others then read the cache, so a node fetches each file once."""
import os
from typing import Optional

from swift_megatron.errors import UserError


def _download(model_id: str, use_hf: bool, revision: Optional[str]) -> str:
    try:
        if use_hf:
            from huggingface_hub import snapshot_download
            return snapshot_download(model_id, revision=revision)
        from modelscope.hub.snapshot_download import snapshot_download
        return snapshot_download(model_id, revision=revision)
    except Exception as exc:  # network errors, unknown ids, auth: all user-facing here
        hub = "Hugging Face" if use_hf else "ModelScope"
        raise UserError(f"--model {model_id}: could not download it from {hub} ({exc}). Pass a "
                        "local model directory, or check the id and your network"
                        + ("" if use_hf else " (or --use_hf true for Hugging Face)")) from None


def check_model_name(model: str, flag: str = "--model") -> None:
    """UserError when `model` is neither a local directory nor shaped like a hub id
    (owner/name): a path that does not exist, caught before anything downloads or starts."""
    if os.path.isdir(model):
        return
    if model.startswith((".", "/", "~")) or os.sep * 2 in model or model.count("/") != 1:
        raise UserError(f"{flag} {model}: no such directory, and not a hub id (owner/name)")


def resolve_model_dir(model: str, use_hf: bool = False, revision: Optional[str] = None) -> str:
    if os.path.isdir(model):
        return model
    check_model_name(model)
    import torch.distributed as dist

    local_first = dist.is_initialized() and int(os.environ.get("LOCAL_RANK", "0")) != 0
    if local_first:
        dist.barrier()
    path = _download(model, use_hf, revision)
    if dist.is_initialized() and not local_first:
        dist.barrier()
    return path


def hub_config(model: str, use_hf: bool = False, revision: Optional[str] = None) -> dict:
    """config.json of a hub id, downloaded alone (planning needs no weights)."""
    import json

    check_model_name(model)
    try:
        if use_hf:
            from huggingface_hub import hf_hub_download
            path = hf_hub_download(model, "config.json", revision=revision)
        else:
            from modelscope.hub.file_download import model_file_download
            path = model_file_download(model, "config.json", revision=revision)
    except Exception as exc:  # network errors, unknown ids, auth: all user-facing here
        hub = "Hugging Face" if use_hf else "ModelScope"
        raise UserError(f"--model {model}: could not download its config.json from {hub} "
                        f"({exc}); pass a local directory holding config.json") from None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
