"""Worker: the GRPO loss, its metrics, the gradients and the logprobs of one optimizer step's
micro-batches, computed on padded and on packed (THD) micro-batches of the same completions of
very different lengths, and on packed micro-batches formed by a token budget (a different number
of micro-batches), for a dense, a MoE and (--tp 1) a hybrid Gated DeltaNet tiny model; writes all
to {out_dir}/rank{R}.json. --tp 2 runs tensor parallel with sequence parallelism (the packed row
padded to a multiple of TP), which Gated DeltaNet's packed path does not support.
"""
import argparse
import json
import os
from functools import partial

import torch
from megatron.core import parallel_state as mpu

from swift_megatron.model.build import build_model
from swift_megatron.parallel.state import ParallelState
from swift_megatron.rlhf.grpo.batch import Sample, split_micro_batches
from swift_megatron.rlhf.grpo.objective import (LossSettings, StepConstants, collect_logprobs,
                                                grpo_loss)
from swift_megatron.training.optim import wrap_ddp
from swift_megatron.training.step import forward_backward

DENSE = dict(model_type="qwen3", vocab_size=250, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
             tie_word_embeddings=False)
MOE = dict(DENSE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True)
# qwen3_5's text stack: two Gated DeltaNet layers, then gated full attention
HYBRID = dict(DENSE, model_type="qwen3_5_text", num_hidden_layers=3,
              layer_types=["linear_attention", "linear_attention", "full_attention"],
              linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, partial_rotary_factor=0.25)
PROMPT_LENGTHS = (3, 9, 5, 14, 2, 7)
COMPLETION_LENGTHS = (1, 30, 12, 4, 21, 8)


def samples():
    gen = torch.Generator().manual_seed(7)
    out = []
    for i, (p, c) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS)):
        ids = torch.randint(1, DENSE["vocab_size"], (p + c,), generator=gen).tolist()
        out.append(Sample(group_id=i // 2, prompt_id=i, prompt_ids=ids[:p], completion_ids=ids[p:],
                          rollout_logprobs=(-torch.rand(c, generator=gen)).tolist(),
                          finish_reason="stop", rewards=[], advantage=float(i % 3) - 1.0))
    return out


def step(model, micro, settings):
    constants = StepConstants(num_sequences=len(PROMPT_LENGTHS), num_micro_batches=len(micro),
                              num_tokens=float(sum(mb["completion_mask"].sum() for mb in micro)),
                              contribution_scale=float(len(micro)))
    model.zero_grad_buffer()
    outputs = forward_backward([model], micro, partial(grpo_loss, settings, constants))
    grads = {name: _reduced(p) for name, p in model.module.named_parameters()}
    with torch.no_grad():
        logprobs = forward_backward([model], micro, partial(collect_logprobs, settings), True)
    return outputs, grads, [o["logprobs"] for o in logprobs]


def _reduced(param):
    """The gradient summed as megatron's gradient reduction sums it: sequence-parallel
    parameters (norms, the router) over TP, expert weights over the expert-data-parallel ranks
    (the TP ranks here, each of which routed its own sequence shard). Each TP rank saw a
    sequence shard, and the padded and packed layouts shard the sequence differently, so only
    these sums are comparable."""
    grad = param.main_grad.clone()
    if getattr(param, "sequence_parallel", False):
        torch.distributed.all_reduce(grad, group=mpu.get_tensor_model_parallel_group())
    elif not getattr(param, "allreduce", True):  # an expert weight
        torch.distributed.all_reduce(grad, group=mpu.get_expert_data_parallel_group())
    return grad


def run(hf, tp, sp):
    model, cfg, shape = build_model(hf, torch.float32, torch.device("cpu"), sequence_parallel=sp)
    ddp = wrap_ddp(model, cfg, False)
    settings = LossSettings(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None,
                            importance_sampling_level="token", temperature=0.9,
                            max_completion_length=32, vocab_size=shape.vocab_size,
                            rollout_correction="token_truncate")
    result = {}
    for layout in ("padded", "packed", "budget"):
        micro = split_micro_batches(samples(), 3, pad_id=0, pad_to_multiple=tp if sp else 1,
                                    packed=layout != "padded",
                                    max_tokens=48 if layout == "budget" else None)
        outputs, grads, logprobs = step(ddp, micro, settings)
        masks = [mb["completion_mask"] for mb in micro]
        result[layout] = dict(
            micro_batches=len(micro), loss=sum(float(o["loss"]) for o in outputs),
            entropy=[float(o["entropy"]) for o in outputs],
            clip=[float(o["clip_ratio/high"]) for o in outputs],
            logprobs=[(lp * m).tolist() for lp, m in zip(logprobs, masks)],
            grads={name: g.flatten()[:64].tolist() for name, g in grads.items()},
            grad_norm=float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--tp", type=int, default=1)
    a = parser.parse_args()
    ParallelState.initialize(tp=a.tp, etp=a.tp, device="cpu", seed=11)
    models = (("dense", DENSE), ("moe", MOE)) + ((("hybrid", HYBRID),) if a.tp == 1 else ())
    results = {name: run(hf, a.tp, sp=a.tp > 1) for name, hf in models}
    with open(os.path.join(a.out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
