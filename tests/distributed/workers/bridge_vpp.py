"""Worker: the bridge and the model directory with the interleaved pipeline (--pp 2 --vpp 2 on
a 4-layer tiny checkpoint: two model chunks per stage). Loads the HF checkpoint into the chunks,
exports it back and compares every tensor bit for bit, compares the forward logits with
transformers, then saves a Megatron model directory from the chunks and reloads it into fresh
(zeroed) chunks and exports again. Writes {out_dir}/rank{R}.json.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/workers/bridge_vpp.py \\
        --out_dir OUT --hf_dir TINY_QWEN3
"""
import argparse
import functools
import json
import os
import types


def chunks_of(hf_config, state):
    import torch

    from swift_megatron.bridge import Bridge
    from swift_megatron.model.build import build_chunks

    chunks, config, shape = build_chunks(hf_config, torch.float32, state.device, random_init=False)
    return chunks, Bridge(hf_config, shape, config)


def logits_max_diff(chunks, shape, hf_dir: str, state) -> float:
    """max |Megatron - transformers| of the float32 logits on seeded random tokens (every rank)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from swift_megatron.export import random_tokens
    from swift_megatron.export.logits import _gathered_logits
    from swift_megatron.training.step import forward_backward

    tokens = random_tokens(shape.vocab_size, shape.max_position_embeddings, "cpu")
    batch = {"tokens": tokens,
             "position_ids": torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()}
    with torch.no_grad():
        out = forward_backward(chunks, [batch], functools.partial(_gathered_logits,
                                                                 shape.vocab_size), True)
        diff = torch.zeros(())
        if state.is_last_stage:
            reference = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(tokens).logits
            diff = (out[0]["logits"] - reference).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def main():
    from swift_megatron.checkpoint.dist import load_model, save_model
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.parallel.state import ParallelState
    from tests.distributed.workers.bridge_layouts import compare_export

    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--hf_dir", required=True)
    args = parser.parse_args()
    state = ParallelState.initialize(pp=2, vpp=2, device="cpu", seed=0)
    hf_config = load_hf_config(args.hf_dir)
    chunks, bridge = chunks_of(hf_config, state)
    bridge.load(chunks, args.hf_dir)
    result = {"chunks": len(chunks),
              "export": compare_export(types.SimpleNamespace(bridge=bridge, model=chunks),
                                       args.hf_dir),
              "logits_max_diff": logits_max_diff(chunks, bridge.shape, args.hf_dir, state)}
    model_dir = os.path.join(args.out_dir, "model_dir")
    save_model(chunks, model_dir)
    fresh, fresh_bridge = chunks_of(hf_config, state)
    load_model(fresh, model_dir)
    result["reloaded_export"] = compare_export(types.SimpleNamespace(bridge=fresh_bridge,
                                                                     model=fresh), args.hf_dir)
    with open(os.path.join(args.out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
