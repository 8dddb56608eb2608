"""Weight sync from the trainer to vLLM: buckets, their wire format, the communicator, and the
vLLM worker extension that receives and loads them.

Protocol (docs/rollout.md has the whole picture):
- The trainer's export stream ((hf_name, full tensor), one at a time, the same on every rank)
  is cut into buckets of about `--weight_sync_bucket_mb`; a tensor larger than a bucket travels
  alone.
- Colocate: each bucket goes to the in-process engine's `weight_sync_load` (through
  `collective_rpc`), which calls the model's `load_weights(bucket)`.
- Server: for each bucket the trainer's rank 0 POSTs its metadata (names, dtypes, shapes,
  `last`) to `/update_weights`, then broadcasts the bucket as ONE flat byte buffer (each tensor
  at a 64-byte aligned offset) over a communicator that joins it with every server worker:
  NCCL on CUDA, gloo (a standalone ProcessGroupGloo over a TCPStore) on the CPU. The workers
  receive into the same layout (`weight_sync_receive`) and load views of it.
- The first bucket of an update begins a load session and the `last` one finishes it
  (vllm_compat: the CPU repacks there); the engine then resets its prefix cache and bumps its
  weight version.

`WeightSyncWorker` is vLLM's `worker_extension_cls`: vLLM mixes it into its worker class, so
its methods run inside every vLLM worker and are called by name through `collective_rpc`.
"""
import dataclasses
import socket
from datetime import timedelta
from typing import Iterable, Iterator, List, Sequence, Tuple

import torch

from swift_megatron.rollout import vllm_compat

WORKER_EXTENSION = "swift_megatron.rollout.weight_sync.WeightSyncWorker"
ALIGN = 64
DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
NamedTensor = Tuple[str, torch.Tensor]


# ---- buckets ---------------------------------------------------------------------------------
def iter_buckets(named_tensors: Iterable[NamedTensor], bucket_bytes: int
                 ) -> Iterator[Tuple[List[NamedTensor], bool]]:
    """(bucket, is_last): consecutive tensors up to bucket_bytes each (one bucket per oversized
    tensor), holding one bucket back so the final one is marked."""
    pending: List[NamedTensor] = []
    size = 0
    held = None
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            if held is not None:
                yield held, False
            held, pending, size = pending, [], 0
        pending.append((name, tensor))
        size += nbytes
    if held is not None:
        yield held, not pending
    if pending:
        yield pending, True


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bucket on the wire."""

    name: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPES[self.dtype].itemsize


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    dtype = str(tensor.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise TypeError(f"weight sync: {name} has unsupported dtype {tensor.dtype}")
    return TensorSpec(name, dtype, tuple(tensor.shape))


def layout(specs: Sequence[TensorSpec]) -> Tuple[List[int], int]:
    """Byte offset of each tensor in the flat buffer, and the buffer's size."""
    offsets, cursor = [], 0
    for spec in specs:
        offsets.append(cursor)
        cursor += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, cursor


def pack(bucket: Sequence[NamedTensor], device: torch.device
         ) -> Tuple[List[TensorSpec], torch.Tensor]:
    """The bucket's specs and its flat uint8 buffer on `device`."""
    specs = [spec_of(name, tensor) for name, tensor in bucket]
    offsets, total = layout(specs)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, tensor), spec, offset in zip(bucket, specs, offsets):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[offset:offset + spec.nbytes].copy_(data)
    return specs, flat


def unpack(specs: Sequence[TensorSpec], flat: torch.Tensor) -> List[NamedTensor]:
    """Views of the flat buffer, one per spec."""
    offsets, _ = layout(specs)
    return [(s.name, flat[o:o + s.nbytes].view(DTYPES[s.dtype]).reshape(s.shape))
            for s, o in zip(specs, offsets)]


# ---- communicators ---------------------------------------------------------------------------
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent): 127.0.0.1 for a
    loopback host, the host itself for one of this machine's own addresses."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    finally:
        probe.close()


class GlooCommunicator:
    """A gloo group outside torch.distributed's global state (the trainer has its own world):
    a TCPStore served by rank 0 and a ProcessGroupGloo over it. Rank 0's store listens on `host`
    only (torch's TCPStore alone listens on every interface), as vLLM's NCCL group does, and
    every rank's gloo connections use this machine's address towards `host` (gloo's default is
    the address of the machine's hostname); with a wildcard host (0.0.0.0) gloo's default stays."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cpu")
        listen_fd = None
        if rank == 0:   # the store's server takes over this bound socket's descriptor
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen()
            listen_fd = listener.detach()
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                   master_listen_fd=listen_fd)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_default_device() if host in WILDCARD_HOSTS
                             else dist.ProcessGroupGloo.create_device(
                                 hostname=local_address_towards(host))]
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("weight_sync", self.store), rank,
                                           world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.group.broadcast(tensor, src).wait()

    def close(self) -> None:
        self.group = None
        self.store = None


def open_communicator(backend: str, host: str, port: int, rank: int, world_size: int,
                      device: torch.device, timeout_s: float = 600.0):
    """Join the weight-sync group: `backend` "nccl" (CUDA tensors on `device`) or "gloo"."""
    if backend == "nccl":
        return vllm_compat.NcclCommunicator(host, port, rank, world_size, device, timeout_s)
    if backend == "gloo":
        return GlooCommunicator(host, port, rank, world_size, timeout_s)
    raise ValueError(f"unknown weight-sync backend {backend!r}")


# ---- inside vLLM's workers -------------------------------------------------------------------
class WeightSyncWorker:
    """vLLM worker extension (`worker_extension_cls`): receive and load weight buckets."""

    def weight_sync_load(self, named_tensors: Sequence[NamedTensor], last: bool) -> None:
        """Load one bucket (beginning an update with the first one, finishing it with the last)."""
        if not getattr(self, "_weight_sync_active", False):
            vllm_compat.begin_weight_update(self)
            self._weight_sync_active = True
        vllm_compat.load_weights(self, named_tensors)
        if last:
            vllm_compat.finish_weight_update(self)
            self._weight_sync_active = False

    def weight_sync_open(self, backend: str, host: str, port: int, world_size: int,
                         rank_offset: int, timeout_s: float) -> None:
        """Join the trainer's weight-sync group as rank rank_offset + this worker's rank."""
        self.weight_sync_close()
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._weight_sync_comm = open_communicator(backend, host, port, rank, world_size,
                                                   self.device, timeout_s)

    def weight_sync_receive(self, specs: List[dict], src: int, last: bool) -> None:
        """Receive one broadcast bucket from rank `src` and load it."""
        comm = getattr(self, "_weight_sync_comm", None)
        if comm is None:
            raise RuntimeError("weight sync: no communicator; POST /init_communicator first")
        specs = [TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in specs]
        _, total = layout(specs)
        flat = torch.empty(total, dtype=torch.uint8, device=comm.device)
        try:
            comm.broadcast(flat, src)
            self.weight_sync_load(unpack(specs, flat.to(self.device)), last)
        except Exception:   # a timeout, a dropped trainer, a tensor the model does not take
            self.weight_sync_abort()
            raise

    def weight_sync_abort(self) -> None:
        """End the update in progress, if any, so that generation works again (see
        vllm_compat.abort_weight_update: its complete layers kept, the rest as before)."""
        if getattr(self, "_weight_sync_active", False):
            vllm_compat.abort_weight_update(self)
            self._weight_sync_active = False

    def weight_sync_close(self) -> None:
        comm = getattr(self, "_weight_sync_comm", None)
        if comm is not None:
            comm.close()
        self._weight_sync_comm = None
