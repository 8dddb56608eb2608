"""Model weights as megatron distributed checkpoints (torch_dist format).

A checkpoint written by any TP/PP/EP layout loads into any other: every rank saves and loads
only its shards, described by megatron's sharded_state_dict. Writes go to `<dir>.tmp-<pid>`
and are renamed into place when every rank has finished, so a crash never leaves a half
written checkpoint under the final name; the next write to the same place removes what a dead
process staged there (paths.py), and the writer processes megatron forks die with
the trainer.
"""
import os
import queue
import shutil
from typing import Sequence, Set

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException

from swift_megatron.checkpoint.forks import writer_children_die_with_us
from swift_megatron.errors import UserError
from swift_megatron.model.wrappers import unwrap
from swift_megatron.paths import staging_dir, sweep_stale


def save_strategy():
    """megatron's torch_dist writer with one thread per core (up to 8) instead of its default 2:
    on a 16-core GPU host the write is IO-bound only with several writer threads."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    _in_process_results_queue()
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=max(2, min(8, os.cpu_count() or 2)))


def _in_process_results_queue() -> None:
    """megatron's torch_dist writer hands its results over through a module-level queue, by
    default one of a multiprocessing Manager it starts on the first save and never stops: a
    server process (~275 MB) and its resource tracker, which outlive a trainer killed with
    `kill -9`. Our saves are synchronous (megatron's execute_sync): the writer puts its results
    and reads them back in this process, so a plain queue does and no process is started."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict:
    """megatron's sharded state dict of this stage: its one chunk's, or {"model0": ...,
    "model1": ...} for the chunks of the interleaved schedule (as megatron's own checkpoints;
    the tensors' keys are global layer names, so any layout loads what another saved)."""
    if len(chunks) == 1:
        return unwrap(chunks[0]).sharded_state_dict()
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def broadcast_str(value: str) -> str:
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def save_model(chunks: Sequence[torch.nn.Module], directory: str, exist_ok: bool = False) -> None:
    """Write this model's weights as a distributed checkpoint at `directory` (atomic)."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not exist_ok:
        raise UserError(f"{directory} exists; pass --exist_ok true to overwrite it")
    tmp = broadcast_str(staging_dir(directory))
    if dist.get_rank() == 0:
        sweep_stale(directory)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    with writer_children_die_with_us():
        dist_checkpointing.save(sharded_state_dict(chunks), tmp, sharded_strategy=save_strategy())
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    dist.barrier()


def _first_failure(exc: Exception) -> str:
    """The first line of what failed: torch's CheckpointException wraps each rank's exception
    (megatron's CheckpointingException naming the tensor and its shapes)."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    return str(exc).strip().splitlines()[0][:300]


def stored_keys(iter_dir: str) -> Set[str]:
    """The keys of every tensor in a torch_dist checkpoint (from its .metadata file)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(iter_dir).read_metadata().state_dict_metadata)


def _base_of_modules_to_save(chunks: Sequence[torch.nn.Module], directory: str) -> dict:
    """The sharded state dict to load. A LoRA checkpoint keeps the base weight of a module
    trained in full beside the trained one (`<module>.lora_base_weight`, lora/saved.py): a model
    that trains no module in full (one without adapters, loading the checkpoint's base) loads
    that base as the module's weight."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from swift_megatron.lora.saved import BASE, saved_modules

    sharded = sharded_state_dict(chunks)
    if any(saved_modules(unwrap(chunk)) for chunk in chunks):
        return sharded
    stored = stored_keys(directory)
    for tensor in nested_values(sharded):
        key = getattr(tensor, "key", "")
        if key.endswith(".weight") and key[:-len("weight")] + BASE in stored:
            tensor.key = key[:-len("weight")] + BASE
    return sharded


def load_model(chunks: Sequence[torch.nn.Module], directory: str) -> None:
    """Load weights saved by save_model (with any parallel layout) into this model."""
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise UserError(f"{directory} is not a megatron distributed checkpoint "
                        "(no metadata.json)")
    try:
        state = dist_checkpointing.load(_base_of_modules_to_save(chunks, directory), directory)
    except (CheckpointingException, CheckpointException) as exc:   # another model's weights
        raise UserError(f"{directory} holds another model than the one built here (from --model's "
                        f"config.json and the flags): {_first_failure(exc)}; give the checkpoint "
                        f"of this model, or the --model it was made from") from None
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(state, strict=True)
    for i, chunk in enumerate(chunks if len(chunks) > 1 else []):
        unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
