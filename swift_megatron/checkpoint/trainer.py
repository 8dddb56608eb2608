"""Training checkpoints: everything needed to resume a run exactly, written atomically.

    SAVE/iter_0000010/              a Megatron model directory (checkpoint/layout.py) plus
        optimizer/                  megatron distributed checkpoint of the optimizer state
        rng/rank{R}.pt              each rank's RNG states (torch, CUDA, megatron's tracker)
        trainer_state.json          step, scheduler, data position, run bookkeeping
    SAVE/latest_checkpointed_iteration.txt

The iteration directory is written as `iter_XXXXXXX.tmp-<pid>` (paths.py) and renamed once every
rank has finished; the `latest` file is replaced atomically afterwards. A save the disk refuses
(full, file size limit, read-only) ends in WriteFailed with the partial directory removed and
the last checkpoint untouched. `--no_save_optim` and `--no_save_rng` leave those parts out (a
resume then starts a fresh optimizer / RNG).
"""
import json
import os
import shutil
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

from swift_megatron.checkpoint.dist import broadcast_str, save_strategy, sharded_state_dict
from swift_megatron.checkpoint.layout import load_model_dir, write_model_dir
from swift_megatron.checkpoint.ms_swift import read_latest
from swift_megatron.errors import UserError
from swift_megatron.paths import removed_if_failed, staging_dir, sweep_stale
from swift_megatron.training.optim import adam_step_tensor, torch_optimizers, use_fused_adam

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
# The distributed optimizer's default format relies on flattened ShardedTensors, which
# megatron-core 0.16.1's checkpointing rejects, and its fully_reshardable loader drops torch
# Adam's `step` (KeyError without Apex/TE). dp_reshardable works: a resume keeps the model-
# parallel layout (TP/PP/EP) of the checkpoint and may change the data-parallel size.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def iteration_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"iter_{step:07d}")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(save_dir: str, step: int, chunks: Sequence[torch.nn.Module], optimizer,
                    trainer_state: dict, *, hf_source_dir: str, meta: dict,
                    save_optim: bool = True, save_rng: bool = True,
                    write_extra: Optional[Callable[[str], None]] = None) -> str:
    """Write SAVE/iter_<step> (collective) and point `latest` at it; returns the directory.
    `write_extra(tmp_dir)` (collective) adds files before the directory is published. A write
    the disk refuses: WriteFailed, the partial directory removed, the last checkpoint kept."""
    final = iteration_dir(save_dir, step)
    tmp = broadcast_str(staging_dir(final))
    kept = kept_checkpoint(save_dir)
    with removed_if_failed(tmp, final, kept, remove=dist.get_rank() == 0):
        if dist.get_rank() == 0:
            sweep_stale(final)
            os.makedirs(tmp)
        dist.barrier()
        _write_parts(tmp, chunks, optimizer, hf_source_dir=hf_source_dir, meta=meta,
                     save_optim=save_optim, save_rng=save_rng, write_extra=write_extra)
        if dist.get_rank() == 0:
            with open(os.path.join(tmp, STATE), "w") as f:
                json.dump(trainer_state, f, indent=2)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_latest(save_dir, step)
    dist.barrier()
    return final


def _write_parts(tmp: str, chunks, optimizer, *, hf_source_dir: str, meta: dict,
                 save_optim: bool, save_rng: bool,
                 write_extra: Optional[Callable[[str], None]]) -> None:
    """The checkpoint's weights, optimizer, RNG and extra files into `tmp` (collective)."""
    write_model_dir(chunks, tmp, hf_source_dir=hf_source_dir, meta=meta)
    if save_optim:
        model_sd = sharded_state_dict(chunks)
        dist_checkpointing.save(optimizer.sharded_state_dict(model_sd, metadata=OPTIM_METADATA),
                                _fresh(tmp, "optimizer"), sharded_strategy=save_strategy())
    if save_rng:
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{dist.get_rank()}.pt"))
    if write_extra is not None:
        write_extra(tmp)
    dist.barrier()


def kept_checkpoint(save_dir: str) -> str:
    """What a failed save leaves to resume from (said in its error)."""
    try:
        step = read_latest(save_dir) if os.path.isfile(os.path.join(save_dir, LATEST)) else None
    except UserError:   # a damaged latest file
        step = None
    if step is None or not os.path.isdir(iteration_dir(save_dir, step)):
        return f"no earlier checkpoint is in {save_dir}"
    return f"the last checkpoint {iteration_dir(save_dir, step)} (step {step}) is intact: " \
           f"resume from it with --load {save_dir}"


def _fresh(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _write_latest(save_dir: str, step: int) -> None:
    tmp = os.path.join(save_dir, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, os.path.join(save_dir, LATEST))


def _init_adam_state(optimizer) -> None:
    """Give a fresh optimizer empty Adam state, `step` included, so that megatron can build the
    sharded state dict it loads into. (Without Apex/TE, megatron-core 0.16.1's distributed
    optimizer reads `step` from the torch optimizer's state, which is empty before the first
    update; its own state initialiser does not create `step`.)"""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": adam_step_tensor(0.0, param, group.get("fused")),
                                          "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


def _adam_states(optimizer):
    for inner in torch_optimizers(optimizer):
        yield from inner.state.values()


def adam_step(optimizer) -> int:
    """Adam's update count (what its bias correction uses); 0 before the first update."""
    return next((int(s["step"]) for s in _adam_states(optimizer) if "step" in s), 0)


def _restore_adam_step(optimizer, step: int) -> None:
    """Set every parameter's Adam `step`. megatron-core 0.16.1 without Apex/TE does not restore
    it (a reloaded distributed optimizer restarts bias correction from 0) and shares one tensor
    between parameters (torch then adds 1 per parameter per update); one fresh tensor each, where
    its group's kernel wants it."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if param in inner.state:
                    inner.state[param]["step"] = adam_step_tensor(float(step), param,
                                                                  group.get("fused"))


def load_checkpoint(directory: str, chunks: Sequence[torch.nn.Module], optimizer,
                    load_optim: bool = True, load_rng: bool = True) -> Optional[dict]:
    """Load weights (and optimizer, RNG when present); returns the trainer state, or None for a
    weights-only model directory (e.g. from `megatron export --to_mcore`)."""
    load_model_dir(chunks, directory)
    state_path = os.path.join(directory, STATE)
    if not os.path.isfile(state_path):
        return None
    optim_dir = os.path.join(directory, "optimizer")
    if load_optim and os.path.isdir(optim_dir):
        _init_adam_state(optimizer)
        model_sd = sharded_state_dict(chunks)
        sharded = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIM_METADATA)
        state = dist_checkpointing.load(sharded, optim_dir)
        with torch.no_grad():  # megatron copies into leaf main params without no_grad
            optimizer.load_state_dict(state)
        use_fused_adam(optimizer)   # the loaded param groups carry the saving run's kernel choice
        with open(os.path.join(directory, STATE)) as f:
            _restore_adam_step(optimizer, json.load(f).get("adam_step", 0))
    rng_path = os.path.join(directory, "rng", f"rank{dist.get_rank()}.pt")
    if load_rng and os.path.isfile(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=False))
    with open(state_path) as f:
        return json.load(f)
