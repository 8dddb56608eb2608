"""Rollout flags: the vLLM engine (shared by the trainer and `megatron rollout`) and how the
trainer reaches it (colocate or server mode, weight sync, memory hand-over)."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

_VLLM_LATER = "vLLM rollouts land with the vLLM issue; the embedded engine is used meanwhile"


@dataclass
class VllmEngineArguments:
    """vLLM engine"""

    vllm_gpu_memory_utilization: float = arg(0.9, "Fraction of GPU memory vLLM may use "
                                             "(weights + KV cache).")
    vllm_tensor_parallel_size: int = arg(1, "vLLM tensor-parallel degree, independent of the "
                                         "Megatron layout.")
    vllm_max_model_len: Optional[int] = arg(None, "vLLM context length. Default: max_length "
                                            "(prompt + completion).")
    vllm_enforce_eager: bool = arg(False, "Disable CUDA graphs in vLLM (saves memory and start time).")
    vllm_enable_prefix_caching: bool = arg(True, "vLLM automatic prefix caching.")

    def __post_init__(self):
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise UserError("--vllm_gpu_memory_utilization must be in (0, 1]")
        if self.vllm_tensor_parallel_size < 1:
            raise UserError("--vllm_tensor_parallel_size must be >= 1")


@dataclass
class RolloutArguments:
    """Rollout (trainer side)"""

    use_vllm: Optional[bool] = arg(None, "Generate with vLLM. Default: true when vLLM is "
                                   "installed, otherwise the embedded transformers engine.",
                                   not_yet={True: _VLLM_LATER})
    vllm_mode: str = arg("colocate", "colocate: a vLLM engine inside every training process; "
                         "server: remote `megatron rollout` servers.",
                         choices=["colocate", "server"])
    sleep_level: int = arg(0, "Colocate: while training, vLLM releases its KV cache (1) or also "
                           "its weights (2).", choices=[0, 1, 2], not_yet=_VLLM_LATER)
    offload_model: bool = arg(False, "Colocate: move training weights and grads to host memory "
                              "during generation.", not_yet=_VLLM_LATER)
    offload_optimizer: bool = arg(False, "Colocate: move optimizer state to host memory during "
                                  "generation.", not_yet=_VLLM_LATER)
    vllm_server_host: List[str] = arg([], "Server mode: host of each `megatron rollout` server.")
    vllm_server_port: List[int] = arg([8000], "Server mode: port of each server (one value for "
                                      "all hosts, or one per host).")
    vllm_server_timeout: float = arg(240.0, "Server mode: seconds to wait for the servers to answer.")
    weight_sync_bucket_mb: int = arg(512, "Weight sync: bucket size in MiB.")
    check_weight_sync: bool = arg(False, "After each sync, compare vLLM's logprobs of fixed tokens "
                                  "with the trainer's and fail past a tolerance.", not_yet=_VLLM_LATER)

    def __post_init__(self):
        if self.vllm_mode == "server" and self.use_vllm is False:
            raise UserError("--vllm_mode server needs vLLM; drop --use_vllm false")
        if self.weight_sync_bucket_mb < 1:
            raise UserError("--weight_sync_bucket_mb must be >= 1")


@dataclass
class ServeArguments:
    """Rollout server"""

    host: str = arg("127.0.0.1", "Address to listen on.")
    port: int = arg(8000, "Port to listen on.")
    vllm_data_parallel_size: int = arg(1, "vLLM engine replicas (each vllm_tensor_parallel_size GPUs).")

    def __post_init__(self):
        if self.vllm_data_parallel_size < 1:
            raise UserError("--vllm_data_parallel_size must be >= 1")
