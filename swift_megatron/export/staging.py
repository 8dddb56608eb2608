"""Output directories written atomically by every rank together: rank 0 stages a directory
under a temporary name (paths.py), the body writes into it, and it is renamed into place,
replacing the old one, once complete; a failed body leaves nothing behind. Collective."""
import contextlib
import os
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swift_megatron.parallel.state import ParallelState


def broadcast_object(value, src: int = 0):
    """`value` of rank `src`, on every rank (a picklable object). Collective."""
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
    return broadcast_object(staging_dir(out_dir))


@contextlib.contextmanager
def staged(out_dir: str, state: "ParallelState"):
    """Yield the staging directory of `out_dir`, publish it when the body succeeds, remove it
    when it fails (rank 0; a failure of the disk: WriteFailed, paths.py). Collective."""
    from swift_megatron.paths import kept_as_before, removed_if_failed

    tmp = _tmp_name(out_dir)
    with removed_if_failed(tmp, os.path.abspath(out_dir), kept_as_before(os.path.abspath(out_dir)),
                           remove=state.rank == 0):
        yield tmp
    _publish(tmp, os.path.abspath(out_dir), state)
