"""ParallelState: the process groups of a run, created once, asked everywhere.

`ParallelState.initialize(...)` starts torch.distributed (from torchrun's environment, or as a
single process), selects the device (platform/), creates megatron's TP/PP/CP/EP/DP groups and
seeds every RNG. --ddp_timeout reaches every group: the world and megatron's groups are given it,
and it becomes torch's default for the groups made later (ours, vLLM's colocated engine's). Everything else asks this object for ranks and groups instead of reaching
into megatron's parallel_state.
"""
import dataclasses
import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from swift_megatron.errors import UserError
from swift_megatron.platform import setup_device

DEFAULT_TIMEOUT_S = 18000000   # --ddp_timeout's default (ms-swift's)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_default_timeout(seconds: float) -> timedelta:
    """--ddp_timeout for every process group made from now on: torch.distributed's default
    timeouts (what new_group falls back to: the groups of vLLM's colocated engine, the rollout
    client's, any later one), which init_process_group and megatron's groups also get
    explicitly."""
    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    return timeout


def _init_distributed(backend: str, timeout: timedelta) -> None:
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a single process, not launched by torchrun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    dist.init_process_group(backend=backend, timeout=timeout)


def _backend(requested: Optional[str], device_backend: str) -> str:
    """--ddp_backend, checked against the device (NCCL needs CUDA tensors)."""
    if requested is None or requested == device_backend:
        return device_backend
    if requested == "nccl":
        raise UserError("--ddp_backend nccl needs CUDA: this run is on the CPU (gloo)")
    return requested


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

    # the uneven pipeline split (--decoder_first/last_pipeline_num_layers) as TransformerConfig
    # settings, for every model built in this layout
    layer_split: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def initialize(cls, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1,
                   device: str = "auto", seed: int = 42, vpp: Optional[int] = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S, backend: Optional[str] = None,
                   first_stage_layers: Optional[int] = None,
                   last_stage_layers: Optional[int] = None) -> "ParallelState":
        """`vpp`: model chunks per pipeline stage (the interleaved schedule), None for one;
        `timeout_s`: --ddp_timeout of every group; `backend`: --ddp_backend (default: the
        device's); `first/last_stage_layers`: the uneven pipeline split."""
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch_device, device_backend = setup_device(device, local_rank)
        timeout = set_default_timeout(timeout_s)
        _init_distributed(_backend(backend, device_backend), timeout)
        world = dist.get_world_size()
        if world % (tp * pp * cp):
            raise UserError(f"world_size={world} is not divisible by TP x PP x CP = {tp * pp * cp}")
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            context_parallel_size=cp, expert_model_parallel_size=ep,
            virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
            expert_tensor_parallel_size=etp, create_gloo_process_groups=True,
            distributed_timeout_minutes=timeout_s / 60)
        split = dict(num_layers_in_first_pipeline_stage=first_stage_layers,
                     num_layers_in_last_pipeline_stage=last_stage_layers)
        state = cls(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=world // (tp * pp * cp),
                    world_size=world, rank=dist.get_rank(), device=torch_device,
                    layer_split={k: v for k, v in split.items() if v is not None})
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
