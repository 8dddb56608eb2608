"""Worker (one process, CPU): --recompute_granularity / --recompute_modules through the code the
trainer runs (the parsed flags -> components.py -> megatron), on tiny checkpoints of every layer
kind we build; writes {out_dir}/rank0.json for tests/unit/test_recompute.py.

    python -m torch.distributed.run --nproc_per_node 1 tests/distributed/workers/recompute.py \\
        --out_dir OUT --model qwen3=DIR --model qwen3_moe=DIR --model qwen3_lora=QWEN3_DIR ...
    (--nproc_per_node 2 ... --tp 2: tensor parallelism with sequence parallelism, one file per
    rank, each rank's gradients are its own shards)

For each model and each flag setting: one packed micro-batch of three sequences (packed RoPE
attention, Gated DeltaNet's packed path), a no-grad forward pass in eval mode (its logits), a
training forward pass, the mean squared logit as the loss, and the backward pass. Reported: the
loss, whether the eval logits equal those of --recompute_granularity none, the largest gradient
difference against it, and the bytes autograd holds for the backward once the forward is done
(the tensors handed to saved_tensors_hooks, deduplicated by storage, parameters left out; a
discarded output, whose storage megatron shrinks to nothing until the backward recomputes it,
counts 0).
"""
import argparse
import json
import os

import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.model.config import load_hf_config
from swift_megatron.model.text_config import text_config
from swift_megatron.parallel.state import ParallelState
from swift_megatron.rlhf.grpo import components
from swift_megatron.training.step import packed_seq_params

LENGTHS = (10, 14, 24)      # one packed micro-batch of 48 tokens
SETTINGS = {
    "qwen3": {"none": [], "default": [],
              "dense": ["--recompute_modules", "core_attn", "mlp", "layernorm"]},
    "qwen3_moe": {"none": [], "default": [],
                  "moe": ["--recompute_modules", "core_attn", "moe"],
                  "moe_layernorm": ["--recompute_modules", "core_attn", "moe", "layernorm"]},
    "qwen3_5": {"none": [], "dense": ["--recompute_modules", "core_attn", "mlp", "layernorm"]},
    "qwen3_5_moe": {"none": [],
                    "moe_layernorm": ["--recompute_modules", "core_attn", "moe", "layernorm"]},
    "qwen3_lora": {"none": [], "dense": ["--recompute_modules", "core_attn", "mlp", "layernorm"]},
}
EXTRA = {"qwen3_lora": ["--train_type", "lora"]}   # adapters on every linear (dropout 0.05)


def packed_batch(vocab: int) -> dict:
    total = sum(LENGTHS)
    tokens = torch.randint(0, vocab, (1, total), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return dict(tokens=tokens, position_ids=positions, cu_seqlens=cu, max_seqlen=max(LENGTHS))


def saved_bytes(saved, params) -> int:
    """Bytes of the distinct storages among `saved` that are not parameters."""
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_case(model_dir: str, state, extra) -> dict:
    layout = ["--tensor_model_parallel_size", str(state.tp), "--sequence_parallel",
              str(state.tp > 1)]
    args = parse_command(RlhfArguments, ["--model", model_dir, "--dataset", "unused", *layout,
                                         *extra], "megatron rlhf")
    hf_config = load_hf_config(model_dir)
    chunks, config, bridge = components._load_model(args, state, model_dir, hf_config,
                                                    torch.float32, None)
    model = chunks[0]
    components.attach_lora(args, model, bridge, None, hf_config)   # --train_type lora only
    batch = packed_batch(text_config(hf_config)["vocab_size"])
    with torch.no_grad():   # the reference / old-logprob forward: eval mode, no autograd
        eval_logits = model.eval()(batch["tokens"], batch["position_ids"], attention_mask=None,
                                   packed_seq_params=packed_seq_params(batch))
    model.train()
    state.seed(11)   # the same dropout masks (LoRA's, torch's and the TP tracker's) in every case
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(batch["tokens"], batch["position_ids"], attention_mask=None,
                       packed_seq_params=packed_seq_params(batch))
        loss = logits.float().pow(2).mean()   # any function of this rank's vocab shard
    held = saved_bytes(saved, params)
    saved.clear()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return dict(loss=loss.item(), saved_bytes=held, grads=grads, eval_logits=eval_logits,
                granularity=config.recompute_granularity,
                modules=list(config.recompute_modules or []))


def check_model(model_dir: str, state, family: str) -> dict:
    report, base = {}, None
    for name, extra in SETTINGS[family].items():
        flags = EXTRA.get(family, []) + (["--recompute_granularity", "none"] if name == "none"
                                         else extra)
        case = run_case(model_dir, state, flags)
        grads, eval_logits = case.pop("grads"), case.pop("eval_logits")
        if base is None:
            base, base_logits = grads, eval_logits
        case["eval_logits_equal"] = torch.equal(eval_logits, base_logits)
        case["grad_names_equal"] = sorted(grads) == sorted(base)
        case["max_grad_diff"] = max(float((grads[n] - base[n]).abs().max()) for n in base)
        case["max_grad"] = max(float(g.abs().max()) for g in base.values())
        case["grads_equal"] = all(torch.equal(grads[n], base[n]) for n in base)
        report[name] = case
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--model", action="append", default=[], help="FAMILY=DIR")
    parser.add_argument("--tp", type=int, default=1, help="TP degree (with SP when > 1)")
    a = parser.parse_args()
    state = ParallelState.initialize(tp=a.tp, etp=a.tp, device="cpu", seed=1234)
    report = {}
    for item in a.model:
        family, model_dir = item.split("=", 1)
        report[family] = check_model(model_dir, state, family)
    with open(os.path.join(a.out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(report, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
