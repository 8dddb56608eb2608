"""Worker (CPU): routing replay (model/routing_replay.py) in a parallel layout, through the code
the trainer runs (flags -> components.py's policy with --router_replay_mode R3 -> the GRPO
micro-batches of rlhf/grpo/batch.py -> training/step.py); writes {out_dir}/rank{r}.json for
tests/distributed/test_routing_replay_layouts.py (and its helpers serve
tests/unit/test_routing_replay.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/routing_replay.py \\
        --out_dir OUT --model TINY_QWEN3_MOE --layout tp2

Three completions of the tiny qwen3_moe (8 experts, top 2) carry forced routes: distinct random
experts at every position and layer (`forced_samples`). Reported on the last pipeline stage:
each sample's logprobs of every position under replay (forward-only pass), for comparison with
transformers' model whose routers are forced to the same experts (`hf_forced_logprobs`); with
--recompute, the largest gradient difference of a training pass under full recomputation
against the same pass without it (replayed routes popped in the backward's order), and the
routers' queues after the passes.
"""
import argparse
import json
import os
from functools import partial
from typing import List

import torch

LENGTHS = (10, 14, 24)     # prompt 3 tokens + completion, per sample
PROMPT = 3
LAYOUTS = {
    "single": [],
    "tp2": ["--tensor_model_parallel_size", "2", "--sequence_parallel", "true"],
    "ep2": ["--expert_model_parallel_size", "2"],
    "pp2": ["--pipeline_model_parallel_size", "2"],
    "pp2_vpp2": ["--pipeline_model_parallel_size", "2",
                 "--virtual_pipeline_model_parallel_size", "2"],
    "cp2": ["--context_parallel_size", "2"],
    "cp2_padded": ["--context_parallel_size", "2", "--padding_free", "false"],
}


def forced_samples(hf_config: dict, seed: int = 0) -> list:
    """Three completions with random tokens and, at each of the positions the model reads,
    top_k distinct random experts per layer."""
    from swift_megatron.model.text_config import text_config
    from swift_megatron.rlhf.grpo.batch import Sample

    gen = torch.Generator().manual_seed(seed)
    text = text_config(hf_config)
    layers, experts, top_k = (text["num_hidden_layers"], text["num_experts"],
                              text["num_experts_per_tok"])
    samples = []
    for index, length in enumerate(LENGTHS):
        tokens = torch.randint(10, 400, (length,), generator=gen).tolist()
        routes = torch.rand(length - 1, layers, experts, generator=gen).argsort(-1)[..., :top_k]
        samples.append(Sample(group_id=index, prompt_id=index, prompt_ids=tokens[:PROMPT],
                              completion_ids=tokens[PROMPT:], rollout_logprobs=None,
                              finish_reason="stop", rewards=[],
                              routed_experts=routes.to(torch.int16).numpy()))
    return samples


def forced_router(routes: torch.Tensor):
    """A forward hook on a transformers top-k router that makes it choose `routes` [tokens,
    top_k]: its weights are its softmax gathered at them (renormalised when it renormalises)."""
    def force(module, args, output):
        logits = output[0]
        probs = torch.softmax(logits.float(), dim=-1).gather(1, routes)
        if getattr(module, "norm_topk_prob", True):
            probs = probs / probs.sum(-1, keepdim=True)
        return logits, probs.to(logits.dtype), routes
    return force


def hf_forced_logprobs(model_dir: str, samples) -> List[torch.Tensor]:
    """Each sample's logprob of every next token under transformers' model (float32) whose
    routers take the sample's routes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    out = []
    for sample in samples:
        routes = torch.as_tensor(sample.routed_experts).long()
        handles = [r.register_forward_hook(forced_router(routes[:, layer]))
                   for layer, r in enumerate(routers)]
        ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1]).logits[0].float()
        out.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0])
        for handle in handles:
            handle.remove()
    return out


def flags(model_dir: str, *extra):
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command

    return parse_command(RlhfArguments, ["--model", model_dir, "--dataset", "unused",
                                         "--router_replay_mode", "R3", *extra], "megatron rlhf")


def policy(args, state, model_dir: str):
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.rlhf.grpo import components

    chunks, config, bridge = components._load_model(args, state, model_dir,
                                                    load_hf_config(model_dir), torch.float32,
                                                    None)
    return chunks, bridge


def micro_batch(args, state, samples) -> dict:
    """All samples in one micro-batch of the layout (the trainer's padding multiples)."""
    from swift_megatron.parallel.context import padding_multiples
    from swift_megatron.rlhf.grpo.batch import split_micro_batches

    tp_multiple = state.tp if args.parallel.sequence_parallel else 1
    row, sequence = padding_multiples(tp_multiple, state.cp)
    [micro] = split_micro_batches(samples, len(samples), pad_id=0, pad_to_multiple=row,
                                  sequence_multiple=sequence, packed=args.kernels.padding_free)
    return micro


def settings(bridge):
    from swift_megatron.rlhf.grpo.objective import LossSettings

    return LossSettings(loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.2, delta=None,
                        importance_sampling_level="token", temperature=1.0,
                        max_completion_length=32, vocab_size=bridge.shape.vocab_size)


def logprobs(chunks, micro, loss_settings) -> list:
    """Each sample's logprobs of every position (last stage; [] elsewhere)."""
    from swift_megatron.rlhf.grpo.objective import collect_logprobs
    from swift_megatron.training.step import forward_backward

    outputs = forward_backward(chunks, [micro], partial(collect_logprobs, loss_settings), True)
    return [out["logprobs"][row, :n - 1].tolist()
            for out in outputs for row, n in enumerate(LENGTHS)]


def grads(chunks, micro, loss_settings) -> dict:
    """This rank's parameter gradients after one training pass (loss: minus the mean logprob)."""
    from swift_megatron.rlhf.grpo.objective import token_logprobs
    from swift_megatron.training.step import forward_backward

    def loss(mb, output):
        values = token_logprobs(mb, output, loss_settings)
        return -(values * mb["completion_mask"]).sum() / mb["completion_mask"].sum(), {}

    for chunk in chunks:
        chunk.train()
        chunk.zero_grad(set_to_none=True)
    with torch.enable_grad():
        forward_backward(chunks, [micro], loss)
    return {f"{i}.{n}": p.grad.clone() for i, chunk in enumerate(chunks)
            for n, p in chunk.named_parameters() if p.grad is not None}


def queued(chunks) -> int:
    from swift_megatron.model.routing_replay import replay_routers

    return sum(len(router.replay_backward_list) + (router.target_topk_idx is not None)
               for chunk in chunks for _, router in replay_routers(chunk))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="single")
    parser.add_argument("--recompute", action="store_true")
    a = parser.parse_args()
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.rlhf.grpo import components

    args = flags(a.model, *LAYOUTS[a.layout])
    state = components.parallel_state(args)
    chunks, bridge = policy(args, state, a.model)
    micro = micro_batch(args, state, forced_samples(load_hf_config(a.model)))
    loss_settings = settings(bridge)
    report = dict(logprobs=logprobs(chunks, micro, loss_settings), queued=queued(chunks))
    if a.recompute:
        plain = grads(chunks, micro, loss_settings)
        recompute_args = flags(a.model, *LAYOUTS[a.layout], "--recompute_granularity", "full",
                               "--recompute_method", "uniform", "--recompute_num_layers", "1")
        recomputed = grads(policy(recompute_args, state, a.model)[0], micro, loss_settings)
        report.update(grad_diff=max(float((plain[n] - recomputed[n]).abs().max()) for n in plain),
                      grad_max=max(float(g.abs().max()) for g in plain.values()),
                      same_params=sorted(plain) == sorted(recomputed))
    report["queued_after"] = queued(chunks)
    with open(os.path.join(a.out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(report, f)
    state.destroy()


if __name__ == "__main__":
    main()
