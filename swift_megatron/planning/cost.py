"""A cost model of one GRPO rollout batch (generation, logprob passes, optimizer steps, weight
sync) for a candidate layout, in seconds on H100/H200-class GPUs. Pure arithmetic.

- compute: 6 x N_active FLOPs per trained token (2 forward, 4 backward; full recomputation one
  more forward, 2 x N_active), 2 x N_active per logprob-pass token, plus the attention score
  and value products (6 x query width x sequence length per full-attention layer and token,
  causal), spread over every GPU at TRAIN_MFU of the bf16 peak; LoRA's train phase x
  LORA_TRAIN_FACTOR; generation (colocate) 2 x N_active per completion token at GENERATE_MFU;
- tensor parallelism: per layer and token 4 collectives of the hidden state (2 forward, 2
  backward; 2 more with full recomputation, 2 per logprob pass), each moving 2 (TP-1)/TP x
  hidden x 2 bytes per GPU, at TP_BANDWIDTH;
- context parallelism: each layer's K and V (2 x kv width x 2 bytes per token) pass the CP-1
  other ranks, once forward and twice backward;
- expert parallelism: per MoE layer 4 all-to-alls (dispatch and combine, forward and backward)
  of top-k x hidden x 2 bytes per token, (EP-1)/EP of it leaving the GPU;
- data parallelism: per optimizer step the distributed optimizer's reduce-scatter of float32
  gradients and all-gather of bf16 parameters, (4 + 2) bytes x trainable parameters of a rank
  x (D-1)/D over D = DP x CP ranks, at DP_BANDWIDTH;
- pipeline: the bubble (PP-1)/m of the in-pipeline time (m micro-batches per step), and each
  stage boundary's activations (forward) and their gradients (backward);
- a fixed cost per micro-batch and layer (MICRO_BATCH_LAYER_SECONDS: launches, packing);
- offloads over PCIe (PCIE_BANDWIDTH): the reference in and out once per rollout batch, the
  Adam state out and back around each generation (--offload_optimizer), gradients down and
  parameters up at every step plus a CPU Adam step (--optimizer_cpu_offload);
- the weight sync to vLLM: the bf16 weights at SYNC_BANDWIDTH (colocate or server).
Groups wider than a node (CP, EP, DP) run at INTER_NODE_BANDWIDTH. Generation in server mode
runs on the rollout servers and is not counted.
"""
import dataclasses
import math
from typing import Dict, Mapping, Optional, Tuple

from swift_megatron.model.layout import PipelineSplit
from swift_megatron.model.memory import GIB, parameter_counts, vision_parameters
from swift_megatron.model.text_config import HYBRID_TYPES, text_config
from swift_megatron.planning.candidates import Layout

# bf16 dense peak of an H100/H200 (benchmarks/trl_compare.py PEAK_BF16_TFLOPS)
PEAK_BF16_FLOPS = 989e12
# docs/gpu.md, Qwen2.5-1.5B on one H200 (trl_compare, 8k token budget): 2 optimizer steps over
# 35.6k tokens in 1.30 s (27.4k tokens/s, 254 TFLOP/s of 6 N); less the 6 micro-batches' fixed
# cost below (0.18 s), 6 N x 35.6k tokens in 1.12 s is 0.30 of the peak
TRAIN_MFU = 0.30
# docs/gpu.md, the same run: rollout 29.8k generated tokens/s = 2 N x 29.8k = 92 TFLOP/s
GENERATE_MFU = 0.093
# docs/gpu.md: LoRA's train phase is 1.29x the full one at TP=1 (1.27x at TP=2), dropout 0.05
LORA_TRAIN_FACTOR = 1.29
# docs/gpu.md, 8k against 16k token budgets (same run): train 1.39 s against 1.33 s for 6
# against 4 micro-batches of the 28-layer model: 0.03 s per micro-batch, 1.1 ms per layer
MICRO_BATCH_LAYER_SECONDS = 1.1e-3
# docs/gpu.md, TP=2 on 2 GPUs against DP=2 (same 256 completions, 8k budget): train 1.67 s
# against 1.30 s; less 4 more micro-batches' fixed cost (0.12 s), 0.25 s for 28 layers x 4
# collectives x 71.6k tokens x 1536 x 2 bytes = 24.6 GB per GPU: 100 GB/s
TP_BANDWIDTH = 100e9
# docs/gpu.md, full-parameter 1.5B on 2 GPUs: the DP gradient reduction added 0.31 s to 2
# optimizer steps, 2 x (4 + 2) bytes x 1.54e9 x 1/2 = 9.3 GB: 30 GB/s
DP_BANDWIDTH = 30e9
# an assumption, not measured here: one 200 Gb/s network adapter per GPU
INTER_NODE_BANDWIDTH = 25e9
# an assumption (issue 43): host <-> GPU copies over PCIe Gen5 x16, about 25 GB/s achieved
PCIE_BANDWIDTH = 25e9
# an assumption, not measured here: a many-core host's Adam step, parameters per second
CPU_ADAM_PARAMS_PER_S = 1e9
# docs/gpu.md: colocate weight sync 3.09 GB in 0.13 s (23 GB/s); server mode, NCCL push to
# `megatron rollout`, 3.09 GB in 0.041 s (75 GB/s)
SYNC_BANDWIDTH = {"colocate": 23e9, "server": 75e9}


@dataclasses.dataclass(frozen=True)
class Work:
    """What one rollout batch asks of the GPUs, whatever the layout."""

    sequences: int               # completions per rollout batch (generation_batch_size)
    sequence_tokens: int         # prompt + completion tokens of one sequence (the longest)
    completion_tokens: int       # generated tokens of one completion
    optimizer_steps: int         # steps_per_generation
    logprob_passes: float        # forward passes over the batch before training (ref, old)
    world: int
    gpus_per_node: int
    colocate: bool = True
    lora: bool = False
    micro_batch_size: int = 1    # completions per micro-batch without a token budget
    image_patches: int = 0       # vision patches per sequence (VL: one image at --max_pixels)
    pipeline_split: Tuple[Optional[int], Optional[int]] = (None, None)   # first / last stage's


def active_parameters(hf: Mapping) -> int:
    """Parameters a token's forward multiplies by: every layer's attention, its dense MLP or
    top-k experts with their router and the shared expert, and the output head (the embedding
    is a lookup)."""
    counts, text = parameter_counts(hf), text_config(hf)
    mlp = counts["mlp"]
    if counts["experts"]:
        hidden = text["hidden_size"]
        mlp = text["num_experts_per_tok"] * 3 * hidden * text["moe_intermediate_size"] + \
            counts["experts"] * hidden
    layer = counts["attention"] + mlp + counts["shared"]
    return text["num_hidden_layers"] * layer + text["vocab_size"] * text["hidden_size"]


def attention_flops_per_token(hf: Mapping, sequence_tokens: int) -> float:
    """Forward + backward of the causal score and value products, per token: 6 x query width x
    sequence length per full-attention layer (Gated DeltaNet layers: none)."""
    text = text_config(hf)
    width = text["num_attention_heads"] * (text.get("head_dim") or
                                           text["hidden_size"] // text["num_attention_heads"])
    kinds = text.get("layer_types") if text.get("model_type") in HYBRID_TYPES else None
    full = sum(k == "full_attention" for k in kinds) if kinds else text["num_hidden_layers"]
    return 6 * width * sequence_tokens * full


def micro_batches(layout: Layout, work: Work, dp: int) -> int:
    """Micro-batches per optimizer step on one DP rank."""
    per_step = math.ceil(work.sequences / work.optimizer_steps / dp)
    per_micro = work.micro_batch_size
    if layout.max_tokens_per_micro_batch:
        per_micro = max(1, layout.max_tokens_per_micro_batch // work.sequence_tokens)
    return max(1, math.ceil(per_step / per_micro))


def _bandwidth(group: int, stride: int, work: Work, inside: float) -> float:
    """`inside` for a group of `group` ranks `stride` apart within one node, else the network."""
    return inside if group * stride <= work.gpus_per_node else INTER_NODE_BANDWIDTH


def _flop_seconds(flops: float, work: Work, mfu: float) -> float:
    return flops / work.world / (PEAK_BF16_FLOPS * mfu)


def compute_seconds(hf: Mapping, layout: Layout, work: Work) -> Dict[str, float]:
    """Generation, logprob passes and training at the calibrated efficiencies."""
    n, tokens = active_parameters(hf), work.sequences * work.sequence_tokens
    attention = attention_flops_per_token(hf, work.sequence_tokens)
    per_token = (6 + 2 * layout.full_recompute) * n + attention * (1 + layout.full_recompute / 3)
    train = _flop_seconds(tokens * per_token, work, TRAIN_MFU)
    vision = 2 * work.image_patches * work.sequences * vision_parameters(hf)
    logprobs = _flop_seconds(work.logprob_passes * (tokens * (2 * n + attention / 3) + vision),
                             work, TRAIN_MFU)
    generated = 2 * n * work.sequences * work.completion_tokens
    rollout = _flop_seconds(generated + vision, work, GENERATE_MFU) if work.colocate else 0.0
    return dict(rollout=rollout, logprobs=logprobs,
                train=train * (LORA_TRAIN_FACTOR if work.lora else 1) +
                _flop_seconds(vision * (1 + layout.full_recompute), work, TRAIN_MFU))


def stage_layers(hf: Mapping, layout: Layout, work: Work) -> int:
    """Decoder layers of the fullest pipeline stage (with --decoder_first/last_pipeline_num_
    layers the stages differ; the pipeline runs at the pace of the fullest)."""
    first, last = work.pipeline_split
    return PipelineSplit(text_config(hf)["num_hidden_layers"], layout.pp,
                         first=first if layout.pp > 1 else None,
                         last=last if layout.pp > 1 else None).fullest()


def communication_seconds(hf: Mapping, layout: Layout, work: Work) -> Dict[str, float]:
    """TP, CP, EP and pipeline-boundary traffic of the train phase and the logprob passes."""
    text, dp = text_config(hf), work.world // (layout.tp * layout.pp * layout.cp)
    hidden, layers = text["hidden_size"], stage_layers(hf, layout, work)
    heads = text["num_attention_heads"]
    kv = (text.get("num_key_value_heads") or heads) * (text.get("head_dim") or hidden // heads)
    tokens = work.sequences * work.sequence_tokens / dp / layout.cp   # per rank of a TP group
    passes = 4 + 2 * layout.full_recompute + 2 * work.logprob_passes
    tp = layers * passes * tokens * hidden * 2 * 2 * (layout.tp - 1) / layout.tp / TP_BANDWIDTH
    cp_bw = _bandwidth(layout.cp, layout.tp, work, TP_BANDWIDTH)
    cp = layers * (3 + work.logprob_passes) * tokens * 2 * kv * 2 * (layout.cp - 1) / cp_bw
    ep = 0.0
    if text.get("num_experts") or text.get("num_local_experts"):
        routed = tokens / (layout.tp if layout.sequence_parallel else 1) * \
            text["num_experts_per_tok"]
        ep_bw = _bandwidth(layout.ep, 1, work, TP_BANDWIDTH)
        ep = layers * passes * routed * hidden * 2 * (layout.ep - 1) / layout.ep / ep_bw
    boundary = (2 + work.logprob_passes) * tokens * hidden * 2 * (layout.pp > 1)
    pp = boundary / _bandwidth(layout.pp, work.world // layout.pp, work, TP_BANDWIDTH)
    return dict(tp=tp, cp=cp, ep=ep, pp=pp)


def gradient_seconds(parts: Mapping[str, float], layout: Layout, work: Work) -> float:
    """The distributed optimizer's reduce-scatter and all-gather at every step; `parts`: the
    memory estimate of this layout (GiB), whose gradients are 4 bytes per trainable parameter."""
    d = work.world // (layout.tp * layout.pp)                 # DP x CP ranks
    trainable = parts["gradients"] * GIB / 4
    bandwidth = _bandwidth(d, layout.tp * layout.pp, work, DP_BANDWIDTH)
    return work.optimizer_steps * 6 * trainable * (d - 1) / d / bandwidth


def offload_seconds(parts: Mapping[str, float], layout: Layout, work: Work) -> float:
    """Host <-> GPU copies of the offloads chosen, and the CPU Adam step."""
    seconds = 2 * parts["reference_bytes"] / PCIE_BANDWIDTH * layout.offload_ref_model
    seconds += 2 * parts["optimizer"] * GIB / PCIE_BANDWIDTH * layout.offload_optimizer
    if layout.optimizer_cpu_offload:
        dp = work.world // (layout.tp * layout.pp)
        shard = parts["gradients"] * GIB / 4 / dp
        seconds += work.optimizer_steps * shard * (6 / PCIE_BANDWIDTH + 1 / CPU_ADAM_PARAMS_PER_S)
    return seconds


def step_seconds(hf: Mapping, layout: Layout, work: Work,
                 parts: Mapping[str, float]) -> Dict[str, float]:
    """{part: seconds} of one rollout batch and their `total`; `parts` as gradient_seconds's,
    with `reference_bytes` (the reference's weights on a rank) and `weight_bytes` (the
    model's bf16 weights, synced to vLLM)."""
    times = compute_seconds(hf, layout, work)
    layers = stage_layers(hf, layout, work)
    for phase in ("train", "logprobs"):   # pipelined: at the pace of the fullest stage
        times[phase] *= layers * layout.pp / text_config(hf)["num_hidden_layers"]
    times.update(communication_seconds(hf, layout, work))
    dp = work.world // (layout.tp * layout.pp * layout.cp)
    m = micro_batches(layout, work, dp)
    times["micro_batches"] = work.optimizer_steps * m * layers * MICRO_BATCH_LAYER_SECONDS
    in_pipeline = times["train"] + times["logprobs"] + times["tp"] + times["cp"] + \
        times["ep"] + times["micro_batches"]
    times["bubble"] = in_pipeline * (layout.pp - 1) / m
    times["dp"] = gradient_seconds(parts, layout, work)
    times["offload"] = offload_seconds(parts, layout, work)
    mode = "colocate" if work.colocate else "server"
    times["sync"] = parts["weight_bytes"] / SYNC_BANDWIDTH[mode]
    times["total"] = sum(times.values())
    return times
