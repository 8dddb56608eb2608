"""ParallelState: the process groups of a run, created once, asked everywhere.

`ParallelState.initialize(...)` starts torch.distributed (from torchrun's environment, or as a
single process), selects the device (platform/), creates megatron's TP/PP/CP/EP/DP groups and
seeds every RNG. Everything else asks this object for ranks and groups instead of reaching
into megatron's parallel_state.
"""
import dataclasses
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from swift_megatron.errors import UserError
from swift_megatron.platform import setup_device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(backend: str) -> None:
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a single process, not launched by torchrun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    dist.init_process_group(backend=backend)


def _replica_group():
    """This rank's group of the ranks that share its data-parallel rank (collective: every rank
    creates every group)."""
    dp_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(dp_ranks, mpu.get_data_parallel_rank())
    mine = None
    for dp_rank in sorted(set(dp_ranks)):
        group = dist.new_group([r for r, d in enumerate(dp_ranks) if d == dp_rank])
        if dp_rank == mpu.get_data_parallel_rank():
            mine = group
    return mine


@dataclasses.dataclass
class ParallelState:
    """Degrees and this rank's coordinates in the TP x CP x EP x DP x PP grid."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    world_size: int
    rank: int
    device: torch.device

    @classmethod
    def initialize(cls, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1,
                   device: str = "auto", seed: int = 42,
                   vpp: Optional[int] = None) -> "ParallelState":
        """`vpp`: model chunks per pipeline stage (the interleaved schedule), None for one."""
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch_device, backend = setup_device(device, local_rank)
        _init_distributed(backend)
        world = dist.get_world_size()
        if world % (tp * pp * cp):
            raise UserError(f"world_size={world} is not divisible by TP x PP x CP = {tp * pp * cp}")
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            context_parallel_size=cp, expert_model_parallel_size=ep,
            virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
            expert_tensor_parallel_size=etp, create_gloo_process_groups=True)
        state = cls(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=world // (tp * pp * cp),
                    world_size=world, rank=dist.get_rank(), device=torch_device)
        state._replica_group = _replica_group() if cp > 1 else mpu.get_model_parallel_group()
        state.seed(seed)
        return state

    def seed(self, seed: int) -> None:
        """Seed torch and megatron's model-parallel RNG tracker (different per PP stage, as
        megatron does, so stages do not share dropout masks)."""
        torch.manual_seed(seed + 100 * self.pp_rank)
        tensor_parallel.model_parallel_cuda_manual_seed(seed + 100 * self.pp_rank)

    # ---- coordinates --------------------------------------------------------------------
    @property
    def vpp(self) -> int:
        """Model chunks per pipeline stage (1 without the interleaved schedule)."""
        return mpu.get_virtual_pipeline_model_parallel_world_size() or 1

    @property
    def tp_rank(self) -> int:
        return mpu.get_tensor_model_parallel_rank()

    @property
    def pp_rank(self) -> int:
        return mpu.get_pipeline_model_parallel_rank()

    @property
    def dp_rank(self) -> int:
        return mpu.get_data_parallel_rank()

    @property
    def is_first_stage(self) -> bool:
        return mpu.is_pipeline_first_stage()

    @property
    def is_last_stage(self) -> bool:
        return mpu.is_pipeline_last_stage()

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    # ---- groups -------------------------------------------------------------------------
    @property
    def tp_group(self):
        return mpu.get_tensor_model_parallel_group()

    @property
    def pp_group(self):
        return mpu.get_pipeline_model_parallel_group()

    @property
    def dp_group(self):
        return mpu.get_data_parallel_group()

    @property
    def mp_group(self):
        """The ranks that together hold one model replica (TP x PP x CP; megatron's model-
        parallel group leaves CP out)."""
        return self._replica_group

    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        return mpu.get_pipeline_model_parallel_last_rank()

    def first_stage_rank(self) -> int:
        return mpu.get_pipeline_model_parallel_first_rank()

    def barrier(self) -> None:
        dist.barrier()

    @staticmethod
    def destroy() -> None:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
