"""Parallelism flags (Megatron naming): TP, PP, VPP, CP, EP, ETP, SP, optimizer sharding, recompute."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

# ms-swift's --recompute_modules values; the ones our layer spec cannot take, with the reason
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe")
REFUSED_RECOMPUTE_MODULES = {
    "mla_up_proj": "it recomputes multi-latent attention's up-projection, and no supported "
                   "model uses MLA",
}


@dataclass
class ParallelArguments:
    """Parallelism"""

    tensor_model_parallel_size: int = arg(1, "Tensor-parallel degree (TP): each layer's weights "
                                          "are split across this many GPUs.")
    pipeline_model_parallel_size: int = arg(1, "Pipeline-parallel degree (PP): the layers are "
                                            "split into this many stages.")
    virtual_pipeline_model_parallel_size: Optional[int] = arg(
        None, "Interleaved pipeline (1F1B): model chunks per pipeline stage (needs PP > 1; "
        "PP x it must divide the layers, and the micro-batches per step be a multiple of PP).")
    context_parallel_size: int = arg(1, "Context-parallel degree (CP): each sequence is split "
                                     "across this many GPUs (megatron's load-balanced layout: "
                                     "2 x CP chunks, every sequence padded to a multiple of "
                                     "2 x CP).")
    expert_model_parallel_size: int = arg(1, "Expert-parallel degree (EP) for MoE models.")
    expert_tensor_parallel_size: int = arg(1, "Tensor-parallel degree inside each expert (ETP). "
                                           "With --expert_model_parallel_size 1 it is set to the "
                                           "tensor-parallel degree: megatron-core reduces the "
                                           "expert gradients over the expert-parallel groups only "
                                           "when EP > 1, so experts replicated over TP ranks "
                                           "would drift apart.")
    sequence_parallel: bool = arg(False, "Megatron sequence parallelism (needs TP > 1): norms "
                                  "and dropout run on sequence shards.")
    use_distributed_optimizer: bool = arg(True, "Shard optimizer state across data-parallel "
                                          "ranks (Megatron's distributed optimizer).")
    recompute_granularity: Optional[str] = arg("selective", "Activation recomputation: full "
                                               "(whole layers), selective (the modules of "
                                               "--recompute_modules) or none.",
                                               choices=["full", "selective", "none"])
    recompute_modules: List[str] = arg(
        ["core_attn"], "With --recompute_granularity selective: the parts of each layer "
        "recomputed in the backward pass. core_attn (attention's softmax(QK^T)V), mlp (a dense "
        "layer's MLP), moe (a whole MoE layer: router, dispatch, experts) checkpoint their "
        "input; layernorm (both norms of a layer) discards its output and recomputes it, "
        "moe_act (grouped experts' SwiGLU) its output. mla_up_proj is refused (no MLA model). "
        "Ignored with the other granularities, as in ms-swift.", choices=RECOMPUTE_MODULES)
    recompute_method: Optional[str] = arg(None, "With --recompute_granularity full: uniform or "
                                          "block.", choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = arg(None, "With --recompute_granularity full: layers "
                                              "per recompute group (uniform) or recomputed "
                                              "layers per stage (block).")

    def __post_init__(self):
        self.adjustments: List[str] = []
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp < 1:
            raise UserError(f"--virtual_pipeline_model_parallel_size must be >= 1, got {vpp}")
        if vpp == 1:
            self.virtual_pipeline_model_parallel_size = None
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            self.adjustments.append("--sequence_parallel true needs "
                                    "--tensor_model_parallel_size > 1: turned off (as ms-swift "
                                    "does)")
            self.sequence_parallel = False
        if self.expert_model_parallel_size == 1 and \
                self.expert_tensor_parallel_size != self.tensor_model_parallel_size:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.recompute_granularity == "none":
            self.recompute_granularity = None
        if self.recompute_granularity == "full" and self.recompute_method is None:
            self.recompute_method, self.recompute_num_layers = "uniform", self.recompute_num_layers or 1
        if self.recompute_method and self.recompute_granularity != "full":
            raise UserError("--recompute_method needs --recompute_granularity full")
        self._check_recompute_modules()

    def _check_recompute_modules(self) -> None:
        """Unknown names are refused by the parser (the field's choices)."""
        for module in self.recompute_modules:
            if module in REFUSED_RECOMPUTE_MODULES:
                raise UserError(f"--recompute_modules {module} is not supported: "
                                f"{REFUSED_RECOMPUTE_MODULES[module]}")
        if self.recompute_granularity != "selective" and self.recompute_modules != ["core_attn"]:
            self.adjustments.append(
                f"--recompute_modules {' '.join(self.recompute_modules)} takes effect with "
                f"--recompute_granularity selective only: ignored with "
                f"{self.recompute_granularity or 'none'} (as ms-swift does)")

    @property
    def selective_recompute(self) -> List[str]:
        """The modules megatron recomputes (none unless --recompute_granularity selective)."""
        return list(self.recompute_modules) if self.recompute_granularity == "selective" else []

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: TP x PP x CP."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)
