"""Check that a local Hugging Face model directory is complete before anything loads it
(`--check_model`, on by default): config.json is readable JSON, every shard the safetensors index
names exists, and every safetensors file has a readable header whose tensors fit in the file (a
truncated download fails here, naming the file, instead of deep inside the bridge).

Pure Python (json + the safetensors header layout: an 8-byte little-endian header length, a JSON
header, then the data), so the dry run can call it without importing torch.
"""
import json
import os
import struct
from typing import Dict, List

from swift_megatron.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header size


def weights_present(model: str) -> bool:
    """Whether a local model directory holds safetensors weights (planning needs none)."""
    return bool(model) and any(os.path.isfile(os.path.join(model, name))
                               for name in (INDEX, SINGLE))


def read_config(model_dir: str) -> dict:
    """config.json of a model directory; UserError naming the file when absent or broken."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--model {model_dir}: no config.json in that directory")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--model {model_dir}: config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"--model {model_dir}: config.json must hold a JSON object")
    return config


def weight_files(model_dir: str) -> List[str]:
    """The safetensors files of a checkpoint: the index's shards, or model.safetensors."""
    index = os.path.join(model_dir, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            return sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index}: not a safetensors index (JSON with a weight_map)") from None
    if os.path.isfile(os.path.join(model_dir, SINGLE)):
        return [SINGLE]
    raise UserError(f"--model {model_dir}: no {SINGLE} or {INDEX} (only safetensors "
                    "checkpoints are supported)")


def safetensors_header(path: str) -> Dict[str, dict]:
    """The header of one safetensors file; UserError when the file is missing or damaged."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: missing (the checkpoint's index names it)")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} does not fit in {size} bytes")
            header = json.loads(f.read(length))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc}); re-download or "
                        "re-export it") from None
    if 8 + length + end > size:
        raise UserError(f"{path}: truncated ({size} bytes, its header needs {8 + length + end}); "
                        "re-download or re-export it")
    return header


def check_model_dir(model_dir: str) -> None:
    """Every check of the module docstring, in order; UserError at the first problem."""
    read_config(model_dir)
    for name in weight_files(model_dir):
        safetensors_header(os.path.join(model_dir, name))
