"""Worker (two processes, CPU): grouped-GEMM experts against megatron-core's SequentialMLP with
expert and expert-tensor parallelism; writes {out_dir}/rank{R}.json for
tests/distributed/test_moe_layouts.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/moe_layouts.py \\
        --out_dir OUT --model TINY_QWEN3_MOE

Layouts: ep2 (EP=2: four experts per rank, tokens exchanged by all-to-all), tp2_sp (TP=2 with
sequence parallelism, so ETP=2: each expert's ffn split over both ranks, tokens all-gathered
and reduce-scattered over expert-TP). In each, three models are built through the bridge from
the same checkpoint: grouped experts, SequentialMLP (both with our dispatcher), and
SequentialMLP with megatron's own all-to-all dispatcher; each runs forward and backward on this
rank's own batch (other tokens on each rank, so uneven all-to-all splits). Reported: grouped
against sequential and our dispatcher against megatron's, the largest difference of this
rank's logits (its vocabulary shard) and of every gradient (grouped weights read per expert),
whether the gradient names match; and each model's host-synchronising calls in one MoE layer's
forward and backward (platform/host_syncs.py).
"""
import argparse
import json
import os

import torch

from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from swift_megatron.bridge import Bridge
from swift_megatron.model.build import build_model
from swift_megatron.model.config import load_hf_config
from swift_megatron.parallel.state import ParallelState
from swift_megatron.platform.host_syncs import HostSyncCounter
from tests.helpers import per_expert_grads

LAYOUTS = {"ep2": dict(ep=2, etp=1), "tp2_sp": dict(tp=2, etp=2)}
FORMS = ("grouped", "sequential", "megatron")
BATCH, SEQ = 2, 24


def run(model_dir: str, form: str, sequence_parallel: bool, rank: int):
    hf = load_hf_config(model_dir)
    model, config, shape = build_model(hf, torch.float32, torch.device("cpu"),
                                       sequence_parallel=sequence_parallel,
                                       moe_grouped_gemm=form == "grouped")
    Bridge(hf, shape, config).load(model, model_dir)
    if form == "megatron":      # SequentialMLP with megatron's own dispatcher
        for layer in model.decoder.layers:
            layer.mlp.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
    ids = torch.randint(0, 500, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    logits = model(input_ids=ids, position_ids=torch.arange(SEQ).expand(BATCH, -1),
                   attention_mask=None)
    (logits.float() ** 2).mean().backward()
    grads = {name: grad.clone() for name, grad in per_expert_grads(model).items()}
    layer = model.decoder.layers[0].mlp
    tokens = SEQ // config.tensor_model_parallel_size if sequence_parallel else SEQ
    x = torch.randn(tokens, BATCH, config.hidden_size, requires_grad=True)
    with HostSyncCounter() as syncs:
        out, _ = layer(x)
        out.backward(torch.randn_like(out))
    return logits.detach(), grads, dict(syncs.counts)


def differences(ours, reference) -> dict:
    (logits, grads, _), (ref_logits, ref_grads, _) = ours, reference
    return dict(logits=(logits - ref_logits).abs().max().item(),
                grads=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
                same_names=sorted(grads) == sorted(ref_grads),
                experts=len([n for n in grads if "local_experts" in n]))


def compare(model_dir: str, layout: dict, rank: int) -> dict:
    ParallelState.initialize(device="cpu", seed=0, **layout)
    sp = layout.get("tp", 1) > 1
    runs = {form: run(model_dir, form, sp, rank) for form in FORMS}
    return dict(grouped=differences(runs["grouped"], runs["sequential"]),
                dispatch=differences(runs["sequential"], runs["megatron"]),
                syncs={form: result[2] for form, result in runs.items()})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--model")
    a = parser.parse_args()
    rank = int(os.environ["RANK"])
    report = {name: compare(a.model, layout, rank) for name, layout in LAYOUTS.items()}
    with open(os.path.join(a.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
