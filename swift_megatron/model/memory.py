"""A per-GPU memory estimate of a GRPO run, from the HF config and the flags alone (pure; the dry
run prints it and warns when it exceeds the device).

Per rank, in bytes:
- weights: this rank's parameters (its PP stage's layers / TP, experts / EP; hybrid models'
  Gated DeltaNet and full-attention layers each counted as they are; the vision tower and
  its mergers, replicated over TP, on the first stage) x dtype bytes;
- gradients: megatron's DDP keeps float32 main gradients of the trainable parameters (4 bytes
  each; LoRA: the adapters only, every expert's in MoE layers, plus --modules_to_save's
  modules, whose base copy also counts as weights; a frozen vision tower, ms-swift's default,
  and what the --freeze_parameters* flags freeze have none);
- embedding_grad (full training, or LoRA training the embedding in full; train phase; none when
  the freeze flags freeze the embedding): the dense bf16 gradient of the word embedding
  that autograd makes before DDP adds it into its main gradient (2 bytes x vocab x hidden / TP;
  inferred, with the output layer's block, from the 5% by which the Qwen3.5-9B shape's measured
  training memory exceeded the estimate without them; not measured alone);
- optimizer: float32 main parameters + Adam's two moments (12 bytes per trainable parameter;
  8 with both moments in bf16, --exp_avg_dtype / --exp_avg_sq_dtype), divided by DP with the
  distributed optimizer; nothing on the GPU with --optimizer_cpu_offload;
- reference: a frozen copy of the weights when beta > 0 and the policy is not LoRA (or, with
  --ref_model, that model's weights); --offload_ref_model keeps it in host memory outside its
  own logprob pass, so it counts in the logprob phase only;
  teacher: --teacher_model's weights (unless offloaded);
- activations of one micro-batch kept for the backward: per token and layer about
  2 x (7 hidden + 2 kv) + 6 x ffn bytes in bf16 (the norms', attention's and the SwiGLU MLP's
  saved inputs and outputs; flash attention keeps no S x S scores; a Gated DeltaNet layer its
  own tensors instead of attention's, `_mixer_values`; an MoE layer, instead of the
  MLP's 6 x ffn: per routed copy of the token (top-k) 2 x (hidden + 6 x the expert's ffn) (its
  permuted input, the expert's gate/up outputs and activations; SequentialMLP, measured on an
  H200 at Qwen3.5-MoE widths, 1,280 tokens: 120.3 KB per token and layer with qwen3
  attention), 2 x (hidden + 3 x ffn) with grouped experts (the permuted input, the fc1 output
  and the weighted SwiGLU output; 2 x ffn with --recompute_modules moe_act; counted on the CPU
  with autograd's saved tensors), 2 x hidden for the router's input and 6 x a shared expert's
  ffn); TP splits q, k, v, the
  attention output and the ffn-wide tensors (2 x (2 hidden + 2 kv) + 6 x ffn), sequence
  parallelism the rest too (measured at TP=2 without it, Qwen2.5-1.5B shape, 8k tokens: 27.5
  GiB of training memory, LoRA 16.7, against 33.7 and 24.4 when all of it was counted whole);
  with full recomputation (--recompute_granularity full) a recompute group's worth (uniform:
  --recompute_num_layers layers) or, with --recompute_method block, the layers not recomputed
  plus one, and the input of every checkpoint (2 x hidden per token); with context parallelism a rank
  holds tokens / CP of them, plus each layer's keys and values all-gathered over the whole
  sequence (kept for the backward). Selective recomputation (--recompute_modules) drops what
  a recomputed module alone keeps: layernorm its two outputs (2 x 2 hidden), mlp (dense) or
  moe (MoE) the MLP's 6 x ffn (its input, a norm output, stays); core_attn nothing here (with
  flash attention it keeps only q, k, v and its output, which its checkpoint and the output
  projection keep anyway); LoRA with --lora_dropout > 0 adds, per token and layer, the dropout
  masks of the adapted inputs (1 byte per element: q/k/v, o, gate/up, down; ms-swift's all-linear
  targets) and the dropped copy of the attention output the o_proj adapter keeps (measured: 29.0
  GiB of training memory against 24.7 estimated without them, Qwen2.5-1.5B shape, 8k tokens);
  a trained vision tower adds its blocks' saved activations for the micro-batch's image patches
  (`vision_activation_bytes`; the image tokens themselves are sequence tokens);
- head: the output layer's logprobs keep no [tokens, vocab] logits (model/logprobs.py): a chunk's
  working set on a GPU (its bf16 logits and their gradient; measured on an H200: 0.384 GiB at
  1,280 tokens with a frozen output layer, for vocabularies of 128k to 248k), the float32
  gradient of the micro-batch's hidden states and a block's bf16 product added into it (6 bytes
  x hidden per token of this CP rank), and, when the output layer trains, a block of its weight
  gradient (CHUNK_BYTES / 4 / tokens vocabulary rows x hidden x 2 bytes);
- vLLM (colocate): --vllm_gpu_memory_utilization of the device while it generates, about
  nothing while asleep (sleep level >= 1).
The peak is the largest of the train phase (everything but vLLM), the logprob phase (the
resident state, the reference and a forward's working set: the head's chunk and one layer's
activations, nothing kept for a backward) and generation (vLLM + what stays resident: the
weights and, unless offloaded, optimizer and reference; the gradients only without a colocated
engine, which generates with them freed).
"""
import dataclasses
from typing import Dict, Mapping, Optional, Tuple

from swift_megatron.model.text_config import HYBRID_TYPES, text_config

GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_STATE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}   # --exp_avg(_sq)_dtype
_CHUNK_BYTES = 256 << 20                 # model/logprobs.py CHUNK_BYTES (float32 logits)
_HEAD_WORKING_BYTES = 3 * _CHUNK_BYTES // 2   # a chunk's bf16 logits, their gradient, buffers


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What the estimate needs from the flags and the batch plan."""

    dtype: str = "bfloat16"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    lora: bool = False
    lora_rank: int = 8
    lora_dropout: bool = False           # --lora_dropout > 0 (with lora)
    reference_copy: bool = True          # a frozen reference on the GPU (beta > 0, not LoRA)
    reference_offloaded: bool = False    # --offload_ref_model: on the GPU in its own pass only
    distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False
    micro_batch_tokens: int = 4096       # prompt + completion tokens of one micro-batch
    full_recompute: bool = False
    recompute_method: str = "uniform"    # with full_recompute: uniform or block
    recompute_num_layers: int = 1        # uniform: layers per group; block: recomputed layers
    recompute_modules: Tuple[str, ...] = ("core_attn",)  # recomputed selectively; () for none
    vllm_fraction: float = 0.0           # colocate: --vllm_gpu_memory_utilization; else 0
    offload_model: bool = False
    offload_optimizer: bool = False
    teacher_parameters: int = 0          # --teacher_model's parameters on this rank (0: none)
    stage_layers: Optional[int] = None   # layers of the fullest stage (uneven split); None: L / pp
    adam_state_bytes: int = 8            # Adam's two moments per trainable parameter (bf16: 2 + 2)
    vision_trainable: bool = False       # full training with --freeze_vit / --freeze_aligner false
    image_patches: int = 0               # vision patches of one micro-batch (VL; 0: not counted)
    frozen_parameters: int = 0           # full: this rank's parameters the freeze flags freeze
    saved_parameters: int = 0            # LoRA: this rank's --modules_to_save parameters
    embedding_trains: Optional[bool] = None  # None: with full training, not with LoRA
    grouped_experts: bool = True         # MoE experts as grouped GEMMs (not LoRA on them)


def _attention_parameters(hf: Mapping) -> int:
    """One full-attention layer's projections (Qwen3.5's query projection also makes its output
    gate: twice the query width)."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads
    gate = heads if hf.get("model_type") in HYBRID_TYPES else 0
    return hidden * head_dim * (heads + gate + 2 * kv) + heads * head_dim * hidden


def _linear_attention_parameters(hf: Mapping) -> int:
    """One Gated DeltaNet layer: q/k/v/z and b/a input projections, the depthwise convolution
    over q, k and v, per-head dt bias and decay, the output norm and projection."""
    hidden, v_heads = hf["hidden_size"], hf["linear_num_value_heads"]
    keys = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    values = v_heads * hf["linear_value_head_dim"]
    return (hidden * (2 * keys + 2 * values + 2 * v_heads)
            + (2 * keys + values) * hf["linear_conv_kernel_dim"] + 2 * v_heads
            + hf["linear_value_head_dim"] + values * hidden)


def parameter_counts(hf: Mapping) -> Dict[str, int]:
    """Parameters of the embedding, the output head (0 when tied), one layer's token mixer
    (attention; for hybrid models the mean over the layers of full and Gated DeltaNet linear
    attention), its dense MLP or its experts (all of them), the shared expert with its gate
    (not split by EP), and norms."""
    hf = text_config(hf)
    hidden = hf["hidden_size"]
    attention = _attention_parameters(hf)
    kinds = hf.get("layer_types") if hf.get("model_type") in HYBRID_TYPES else None
    if kinds:
        linear = _linear_attention_parameters(hf)
        attention = sum(attention if k == "full_attention" else linear for k in kinds) // len(kinds)
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    shared = 0
    if experts:
        mlp = experts * 3 * hidden * hf["moe_intermediate_size"] + experts * hidden
        if hf.get("shared_expert_intermediate_size"):
            shared = 3 * hidden * hf["shared_expert_intermediate_size"] + hidden
    else:
        mlp = 3 * hidden * hf["intermediate_size"]
    embedding = hf["vocab_size"] * hidden
    return dict(embedding=embedding, head=0 if hf.get("tie_word_embeddings") else embedding,
                attention=attention, mlp=mlp, shared=shared, experts=experts, norms=2 * hidden)


def vision_parameters(hf: Mapping) -> int:
    """Parameters of a vision-language config's tower and mergers (`vision_config`; 0 without
    one): Qwen2.5-VL's (RMSNorm, gated MLP, bias-free patch embedding) or Qwen3-VL's and
    Qwen3.5's (LayerNorm, plain MLP, learnt position embedding, Qwen3-VL's deepstack
    mergers); each merger is a norm and two linears over 2x2-merged features."""
    vision = hf.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    width, ffn, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = width * vision.get("spatial_merge_size", 2) ** 2
    out = vision.get("out_hidden_size") or text_config(hf)["hidden_size"]
    embed = 3 * vision.get("temporal_patch_size", 2) * patch * patch * width
    attention = 4 * width * width + 4 * width
    merger = merged * merged + merged + merged * out + out
    if hf.get("model_type") == "qwen2_5_vl":
        block = 2 * width + attention + 3 * width * ffn + 2 * ffn + width
        return embed + vision["depth"] * block + width + merger
    block = 4 * width + attention + 2 * width * ffn + ffn + width
    deepstack = len(vision.get("deepstack_visual_indexes") or ()) * (2 * merged + merger)
    return (embed + width + vision.get("num_position_embeddings", 0) * width
            + vision["depth"] * block + 2 * width + merger + deepstack)


def rank_parameters(hf: Mapping, run: RunShape) -> int:
    """Parameters held by the first pipeline stage's ranks (it holds the embedding and the
    vision tower, replicated over TP; the last stage holds the head: the larger of the two ends
    is counted, a safe side)."""
    counts = parameter_counts(hf)
    layers = _stage_layers(text_config(hf), run)
    mlp = counts["mlp"] / (run.ep if counts["experts"] else 1)
    per_layer = (counts["attention"] + mlp + counts["shared"]) / run.tp + counts["norms"]
    ends = max(counts["embedding"], counts["head"]) / run.tp
    if run.pp == 1:
        ends = (counts["embedding"] + counts["head"]) / run.tp
    return int(layers * per_layer + ends + vision_parameters(hf))


def _trainable(hf: Mapping, run: RunShape, params: int, vision: int) -> int:
    """Every parameter but a frozen vision tower's (`vision` of them) and those the freeze flags
    freeze, or with LoRA the adapters of the 7 linears of each layer: A [r, in] and B [out, r]
    of q, k, v, o, gate, up, down = r (10 hidden + 3 ffn + 2 kv) per layer, and the
    --modules_to_save modules."""
    if not run.lora:
        return params - (0 if run.vision_trainable else vision) - run.frozen_parameters
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = (hf.get("num_key_value_heads") or heads) * (hf.get("head_dim") or hidden // heads)
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if experts:   # every expert's linears adapted, and a shared expert's
        mlp = experts // run.ep * (3 * hidden + 3 * hf["moe_intermediate_size"])
        if hf.get("shared_expert_intermediate_size"):
            mlp += 3 * hidden + 3 * hf["shared_expert_intermediate_size"]
    else:
        mlp = 3 * hidden + 3 * hf["intermediate_size"]
    per_layer = run.lora_rank * (6 * hidden + 2 * kv + mlp)
    return per_layer * _stage_layers(hf, run) // run.tp + run.saved_parameters


def _stage_layers(hf: Mapping, run: RunShape) -> int:
    """Decoder layers of a pipeline stage: the fullest one's with an uneven split."""
    return run.stage_layers or hf["num_hidden_layers"] // run.pp


def activation_bytes(hf: Mapping, run: RunShape) -> int:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = (hf.get("num_key_value_heads") or heads) * (hf.get("head_dim") or hidden // heads)
    moe_ffn = hf.get("moe_intermediate_size", 0) * hf.get("num_experts_per_tok", 0)
    ffn = moe_ffn or hf["intermediate_size"]
    norms = 0 if "layernorm" in run.recompute_modules else 2 * hidden
    mlp = 0 if ("moe" if moe_ffn else "mlp") in run.recompute_modules else \
        _moe_values(hf, run) if moe_ffn else 3 * ffn
    # hidden-wide tensors (the residual stream into both norms, the attention block's output, the
    # norm outputs) are whole on every TP rank unless sequence parallel splits them; q, the core
    # attention output, k, v and the MLP's ffn-wide tensors are split by TP
    replicated, split = 2 * (3 * hidden + norms), 2 * (_mixer_values(hf, kv) + mlp)
    if run.lora and run.lora_dropout:
        attention_out = heads * (hf.get("head_dim") or hidden // heads)
        replicated += 2 * hidden                      # masks of the q/k/v and gate/up inputs
        split += attention_out + ffn + 2 * attention_out
    layers, checkpoints = _kept_layers(_stage_layers(hf, run), run)
    per_token_layer = replicated / (run.tp if run.sequence_parallel else 1) + split / run.tp
    gathered_kv = 2 * 2 * kv / run.tp if run.cp > 1 else 0  # bf16 K and V of every position
    checkpoint_input = 2 * hidden / (run.tp if run.sequence_parallel else 1) / run.cp
    return int(run.micro_batch_tokens * (layers * (per_token_layer / run.cp + gathered_kv)
                                         + checkpoints * checkpoint_input))


def _mixer_values(hf: Mapping, kv: int) -> float:
    """bf16 values a layer's token mixer keeps per token: attention's q, output, k and v
    (2 hidden + 2 kv); for a hybrid model the mean over its layers, a Gated DeltaNet layer
    keeping its convolution's input and output (2 x (2 keys + values)), the L2-normed keys and
    queries (2 keys), fla's saved q and k (repeated to the value heads), v and A (64 per value
    head), and the gated norm's and output projection's tensors (about 5 x values): 103 KB per
    token at Qwen3.5-9B widths, counted on the CPU with fla's saved tensors standing in for its
    kernel."""
    attention = 2 * hf["hidden_size"] + 2 * kv
    kinds = hf.get("layer_types") if hf.get("model_type") in HYBRID_TYPES else None
    if not kinds:
        return attention
    v_heads, key_dim = hf["linear_num_value_heads"], hf["linear_key_head_dim"]
    keys = hf["linear_num_key_heads"] * key_dim
    values = v_heads * hf["linear_value_head_dim"]
    linear = 2 * (2 * keys + values) + 2 * keys + 2 * v_heads * key_dim + 5 * values + 64 * v_heads
    return sum(attention if k == "full_attention" else linear for k in kinds) / len(kinds)


def _moe_values(hf: Mapping, run: RunShape) -> int:
    """bf16 values an MoE layer keeps per token (module docstring)."""
    hidden, top_k = hf["hidden_size"], hf["num_experts_per_tok"]
    shared = hf.get("shared_expert_intermediate_size") or 0
    expert = 6
    if run.grouped_experts:
        expert = 2 if "moe_act" in run.recompute_modules else 3
    return top_k * (hidden + expert * hf["moe_intermediate_size"]) + hidden + 3 * shared


def _head_bytes(hf: Mapping, run: RunShape) -> float:
    """The output layer's logprob working set (module docstring)."""
    hidden, tokens = hf["hidden_size"], max(run.micro_batch_tokens // run.cp, 1)
    block = 0
    if not run.lora:   # the output layer trains: a block of its weight gradient
        rows = min(_CHUNK_BYTES / 4 / tokens, hf["vocab_size"] / run.tp)
        block = 2 * rows * hidden
    return 6 * tokens * hidden + _HEAD_WORKING_BYTES + block


def vision_activation_bytes(hf: Mapping, run: RunShape) -> int:
    """A trained vision tower's saved activations: per patch and block the text layer's
    formula with full-width keys and values, 2 x 9 width + 6 x ffn bytes; a frozen tower
    (no parameter and no input needing a gradient) keeps none."""
    vision = hf.get("vision_config")
    if not (run.vision_trainable and run.image_patches and isinstance(vision, Mapping)):
        return 0
    per_block = 2 * 9 * vision["hidden_size"] + 6 * vision["intermediate_size"]
    return run.image_patches * vision["depth"] * per_block


def _kept_layers(layers: int, run: RunShape) -> Tuple[int, int]:
    """(layers whose activations live at once in the backward, checkpointed layer inputs)."""
    if not run.full_recompute:
        return layers, 0
    recomputed = min(run.recompute_num_layers, layers)
    if run.recompute_method == "block":
        return layers - recomputed + (recomputed > 0), recomputed
    return recomputed, -(-layers // recomputed)


def estimate(hf: Mapping, run: RunShape, device_bytes: Optional[int] = None) -> Dict[str, float]:
    """{part: GiB} per GPU (module docstring), with `train`, `generate`, `peak` and, when
    `device_bytes` is given, `device`."""
    width = _DTYPE_BYTES[run.dtype]
    params, vision = rank_parameters(hf, run), vision_parameters(hf)
    tower_activations = vision_activation_bytes(hf, run)
    hf = text_config(hf)
    trainable = _trainable(hf, run, params, vision)
    optimizer = 0 if run.optimizer_cpu_offload else (4 + run.adam_state_bytes) * trainable / (
        run.dp if run.distributed_optimizer else 1)
    parts = dict(weights=(params + run.saved_parameters) * width, gradients=4 * trainable,
                 optimizer=optimizer,
                 reference=params * width if run.reference_copy else 0,
                 teacher=run.teacher_parameters * width,
                 activations=activation_bytes(hf, run) + tower_activations,
                 head=_head_bytes(hf, run),
                 embedding_grad=2 * hf["vocab_size"] * hf["hidden_size"] / run.tp * (
                     not run.lora if run.embedding_trains is None else run.embedding_trains))
    train = sum(parts.values())
    # a colocated engine generates with the gradients freed (training/offload.py, grad_dropper)
    gradients = parts["gradients"] * (run.vllm_fraction == 0)
    resident = (parts["weights"] + parts["reference"] + gradients) * (not run.offload_model) + \
        parts["optimizer"] * (not run.offload_optimizer) + parts["teacher"]
    one_layer = activation_bytes(hf, dataclasses.replace(run, full_recompute=False)) / \
        _stage_layers(hf, run)
    logprobs = train - parts["activations"] - parts["embedding_grad"] + one_layer + \
        params * width * (run.reference_offloaded and not run.reference_copy)
    vllm = run.vllm_fraction * (device_bytes or 0)
    result = {name: value / GIB for name, value in parts.items()}
    result.update(vllm=vllm / GIB, train=train / GIB, logprobs=logprobs / GIB,
                  generate=(resident + vllm) / GIB)
    result["peak"] = max(result["train"], result["logprobs"], result["generate"])
    if device_bytes:
        result["device"] = device_bytes / GIB
    return result
