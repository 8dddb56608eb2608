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
    decoder_first_pipeline_num_layers: Optional[int] = arg(
        None, "Decoder layers of the first pipeline stage (needs PP > 1); the stages without a "
        "count of their own share the rest equally. E.g. fewer layers beside the embedding (and "
        "a vision tower), or a split of a layer count PP does not divide. Default: even split.")
    decoder_last_pipeline_num_layers: Optional[int] = arg(
        None, "Decoder layers of the last pipeline stage (beside the output layer); as "
        "--decoder_first_pipeline_num_layers.")
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
    overlap_grad_reduce: bool = arg(False, "Start each gradient bucket's data-parallel "
                                    "reduction during the backward pass of the step's last "
                                    "micro-batch, as soon as its gradients are complete, "
                                    "instead of after the backward (megatron's DDP).")
    overlap_param_gather: bool = arg(False, "Distributed optimizer: gather the updated "
                                     "parameters bucket by bucket during the next forward pass "
                                     "instead of right after the optimizer step (needs "
                                     "--overlap_grad_reduce true, as Megatron-LM).")
    ddp_timeout: int = arg(18000000, "Seconds a collective may wait before it fails, for every "
                           "process group of the run (torch.distributed's world, megatron's "
                           "groups, the rollout client's and vLLM's colocated groups). "
                           "ms-swift's default (about 208 days).")
    ddp_backend: Optional[str] = arg(None, "torch.distributed backend: nccl on CUDA, gloo on "
                                     "the CPU. Default: the device's.",
                                     choices=["nccl", "gloo"])
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
    moe_layer_recompute: bool = arg(False, "Recompute each MoE layer in the backward pass "
                                    "(megatron-core 0.12's flag, kept by ms-swift): adds moe to "
                                    "--recompute_modules.")
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
        if self.moe_layer_recompute and "moe" not in self.recompute_modules:
            self.recompute_modules = [*self.recompute_modules, "moe"]
        if self.recompute_granularity == "none":
            self.recompute_granularity = None
        if self.recompute_granularity == "full" and self.recompute_method is None:
            self.recompute_method, self.recompute_num_layers = "uniform", self.recompute_num_layers or 1
        if self.recompute_method and self.recompute_granularity != "full":
            raise UserError("--recompute_method needs --recompute_granularity full")
        self._check_recompute_modules()
        self._check_pipeline_split()
        self._check_overlap()
        if self.ddp_timeout < 1:
            raise UserError(f"--ddp_timeout must be >= 1 second, got {self.ddp_timeout}")

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

    def _check_pipeline_split(self) -> None:
        """Values; the counts against the model's layers: model/layout.py; PP > 1:
        `check_split_has_pipeline` (the command's, since --auto_parallel may choose PP)."""
        for name in self.uneven_pipeline_flags:
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")

    @property
    def uneven_pipeline_flags(self) -> List[str]:
        return [n for n in ("decoder_first_pipeline_num_layers",
                            "decoder_last_pipeline_num_layers") if getattr(self, n) is not None]

    def check_split_has_pipeline(self) -> None:
        """ms-swift's rule: the uneven split needs a pipeline."""
        given = self.uneven_pipeline_flags
        if given and self.pipeline_model_parallel_size == 1:
            raise UserError(f"{' and '.join('--' + n for n in given)} need "
                            "--pipeline_model_parallel_size > 1 (they size the first / last "
                            "pipeline stage)")

    def _check_overlap(self) -> None:
        """Megatron-LM's rules for the overlapped parameter all-gather."""
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise UserError("--overlap_param_gather needs --use_distributed_optimizer true (it "
                            "overlaps the distributed optimizer's parameter all-gather)")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise UserError("--overlap_param_gather needs --overlap_grad_reduce true (as "
                            "Megatron-LM)")

    @property
    def uneven_pipeline(self) -> dict:
        """{"first": n, "last": n} of the uneven pipeline split (empty: even)."""
        split = dict(first=self.decoder_first_pipeline_num_layers,
                     last=self.decoder_last_pipeline_num_layers)
        return {k: v for k, v in split.items() if v is not None}

    @property
    def selective_recompute(self) -> List[str]:
        """The modules megatron recomputes (none unless --recompute_granularity selective)."""
        return list(self.recompute_modules) if self.recompute_granularity == "selective" else []

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: TP x PP x CP."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)
