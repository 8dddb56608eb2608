"""Worker: the tiny Qwen2.5-VL on Megatron (model/vision.py) against transformers, with images.

Loads the HF checkpoint through the bridge in the given layout (TP, PP, sequence parallelism),
exports it back and compares every tensor with the original bit for bit, then runs both models
on two sequences holding one image each (random pixels, seeded) at different places (the
Megatron model through the trainer's micro-batch path) and reports the float32 logit differences; controls: the same Megatron model with 1-D positions on all
three M-RoPE axes, and with other pixels. With --alias_dir it also loads a copy of the checkpoint
saved in transformers' in-memory layout (model.language_model.*, model.visual.*) and exports it.
Writes {out_dir}/rank{R}.json.
"""
import argparse
import json
import os

IMAGE_GRID = (1, 4, 4)   # 56x56 pixels in 14-pixel patches: 16 patches, 4 tokens after merging
SEQ = 32


def inputs(hf_config: dict):
    """(input_ids [2, SEQ], pixel_values, image_grid_thw, mm_token_type_ids), seeded."""
    import torch

    gen = torch.Generator().manual_seed(0)
    start, pad = hf_config["vision_start_token_id"], hf_config["image_token_id"]
    end = hf_config["vision_end_token_id"]
    ids = torch.randint(0, start, (2, SEQ), generator=gen)
    tokens = IMAGE_GRID[1] * IMAGE_GRID[2] // 4
    for row, at in enumerate((3, 17)):
        ids[row, at:at + tokens + 2] = torch.tensor([start] + [pad] * tokens + [end])
    vision = hf_config["vision_config"]
    width = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    pixels = torch.randn(2 * IMAGE_GRID[1] * IMAGE_GRID[2], width, generator=gen)
    grid = torch.tensor([IMAGE_GRID, IMAGE_GRID])
    return ids, pixels, grid, (ids == pad).int()


def megatron_logits(loaded, state, ids, positions, pixels, grid):
    """float32 logits through the trainer's path: one micro-batch with the image entries
    through megatron's (pipelined) schedule (training/step.py), broadcast from the last stage."""
    import functools

    import torch
    import torch.distributed as dist

    from swift_megatron.export import _gathered_logits
    from swift_megatron.training.step import forward_backward

    vocab = loaded.shape.vocab_size
    batch = {"tokens": ids, "position_ids": positions, "pixel_values": pixels,
             "image_grid_thw": grid}
    with torch.no_grad():
        out = forward_backward([loaded.model], [batch], functools.partial(_gathered_logits, vocab),
                               forward_only=True)
    logits = out[0]["logits"].contiguous() if state.is_last_stage else \
        torch.empty(*ids.shape, vocab, dtype=torch.float32)
    if state.pp > 1:
        dist.broadcast(logits, src=state.last_stage_rank(), group=state.pp_group)
    return logits


def diff(a, b) -> float:
    return float((a - b).abs().max())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--hf_dir", required=True)
    parser.add_argument("--alias_dir", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from swift_megatron.export import load_mcore_model
    from swift_megatron.model.config import load_hf_config
    from swift_megatron.parallel.state import ParallelState
    from tests.distributed.workers.bridge_layouts import compare_export

    state = ParallelState.initialize(tp=args.tp, pp=args.pp, device="cpu", seed=0)
    hf_config = load_hf_config(args.hf_dir)
    loaded = load_mcore_model(hf_config, "qwen2_5_vl", torch.float32, state,
                              hf_dir=args.hf_dir, sequence_parallel=args.sp)
    result = {"export": compare_export(loaded, args.hf_dir)}
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    ids, pixels, grid, types = inputs(hf_config)
    with torch.no_grad():
        reference = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=types).logits.float()
        positions, _ = hf.model.get_rope_index(ids, types, image_grid_thw=grid)
    ours = megatron_logits(loaded, state, ids, positions, pixels, grid)
    flat = torch.arange(SEQ).expand(2, SEQ).contiguous()
    result["logits"] = {
        "max_abs_diff": diff(ours, reference),
        "max_abs_logit": float(reference.abs().max()),
        "argmax_agreement": float((ours.argmax(-1) == reference.argmax(-1)).float().mean()),
        "control_1d_positions": diff(megatron_logits(loaded, state, ids, flat, pixels, grid),
                                     reference),
        "control_other_pixels": diff(megatron_logits(loaded, state, ids, positions,
                                                     pixels.flip(0), grid), reference)}
    if args.alias_dir:
        aliased = load_mcore_model(hf_config, "qwen2_5_vl", torch.float32, state,
                                   hf_dir=args.alias_dir)
        result["alias_export"] = compare_export(aliased, args.hf_dir)
    with open(os.path.join(args.out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
