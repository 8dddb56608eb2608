"""Worker: tiny vision-language models on Megatron (model/vision.py) against transformers, with
images: Qwen2.5-VL, Qwen3-VL and Qwen3.5 with its vision tower (one result per `--hf_dir`, by
model_type).

Loads each HF checkpoint through the bridge in the given layout (TP, PP, sequence parallelism),
exports it back and compares every tensor with the original bit for bit, then runs both models
on two sequences holding one image each (random pixels, seeded) at different places (the
Megatron model through the trainer's micro-batch path) and reports the float32 logit
differences; controls: the same Megatron model with 1-D positions on all three M-RoPE axes,
with other pixels, (Qwen3-VL, Qwen3.5) with megatron-core's contiguous M-RoPE sections instead
of the interleaved ones, and (Qwen3-VL) without the deepstack features; then the vision
tower's gradients of sum(logits^2) against transformers' (first stage); and the logits of two
passes with the tower frozen and cached (model/vision_cache.py) and the tower's runs. With
--alias_dir (one per --hf_dir) it also loads a copy of each checkpoint saved in the other
prefix layout and exports it. Writes {out_dir}/rank{R}.json.
"""
import argparse
import json
import os

IMAGE_GRID = (1, 4, 4)   # 16 patches (56x56 or 64x64 pixels in 14- or 16-pixel ones): 4 tokens
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


def megatron_logits(loaded, state, ids, positions, pixels, grid, **entries):
    """float32 logits through the trainer's path: one micro-batch with the image entries (and
    `entries`) through megatron's (pipelined) schedule (training/step.py), broadcast from the
    last stage."""
    import functools

    import torch
    import torch.distributed as dist

    from swift_megatron.export.logits import _gathered_logits
    from swift_megatron.training.step import forward_backward

    vocab = loaded.shape.vocab_size
    batch = {"tokens": ids, "position_ids": positions, "pixel_values": pixels,
             "image_grid_thw": grid, **entries}
    with torch.no_grad():
        out = forward_backward([loaded.model], [batch], functools.partial(_gathered_logits, vocab),
                               forward_only=True)
    logits = out[0]["logits"].contiguous() if state.is_last_stage else \
        torch.empty(*ids.shape, vocab, dtype=torch.float32)
    if state.pp > 1:
        dist.broadcast(logits, src=state.last_stage_rank(), group=state.pp_group)
    return logits


def cached_tower_logits(loaded, state, ids, positions, pixels, grid, plain):
    """(max |logits - `plain`| over two passes with the tower frozen and cached
    (model/vision_cache.py), its runs on the stage holding it: None elsewhere)."""
    from swift_megatron.model.vision import VISUAL
    from swift_megatron.model.vision_cache import frozen_tower_cache

    visual = getattr(loaded.model, VISUAL, None)
    params = [] if visual is None else list(visual.parameters())
    runs = []
    hook = None if visual is None else visual.register_forward_hook(lambda *_: runs.append(1))
    for p in params:
        p.requires_grad_(False)
    try:
        with frozen_tower_cache([loaded.model]):
            worst = max(diff(megatron_logits(loaded, state, ids, positions, pixels, grid,
                                             image_keys=((0, 0), (1, 0))), plain)
                        for _ in range(2))
    finally:
        for p in params:
            p.requires_grad_(True)
        if hook is not None:
            hook.remove()
    return worst, None if visual is None else len(runs)


def diff(a, b) -> float:
    return float((a - b).abs().max())


def contiguous_mrope_logits(loaded, state, ids, positions, pixels, grid):
    """Logits with megatron-core's own (contiguous-section) M-RoPE in place of the interleaved
    one (the Qwen3.5 control; None for families that use the contiguous one)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import \
        MultimodalRotaryEmbedding

    from swift_megatron.model.vision import InterleavedMRoPE

    rotary = loaded.model.rotary_pos_emb
    if not isinstance(rotary, InterleavedMRoPE):
        return None
    rotary.__class__ = MultimodalRotaryEmbedding
    try:
        return megatron_logits(loaded, state, ids, positions, pixels, grid)
    finally:
        rotary.__class__ = InterleavedMRoPE


def no_deepstack_logits(loaded, state, hf_config, ids, positions, pixels, grid):
    """Logits with the deepstack features dropped (the Qwen3-VL control; None for towers
    without deepstack)."""
    from swift_megatron.model.vision import deepstack_indexes

    if not deepstack_indexes(hf_config):
        return None
    loaded.model.deepstack_context = lambda *args: {}
    try:
        return megatron_logits(loaded, state, ids, positions, pixels, grid)
    finally:
        del loaded.model.deepstack_context


def _square_loss(micro_batch, output):
    """Sum of squared logits (of this rank's vocabulary shard: the ranks' losses add up)."""
    logits = output.logits()
    return logits.float().square().sum(), {}


def vision_gradients(loaded, state, hf, ids, positions, pixels, grid, types):
    """Largest difference between the vision tower's gradients (tower, merger, deepstack
    mergers) of the Megatron model (this rank's copy; stage 0) and of transformers, relative to
    the largest gradient, for the loss sum(logits^2); None off the first stage. With sequence
    parallelism each rank sees only its chunk's part of the loss through deepstack: the
    gradients must still be whole on every rank."""
    from swift_megatron.model.vision import VISUAL
    from swift_megatron.training.step import forward_backward

    loaded.model.zero_grad(set_to_none=True)
    batch = {"tokens": ids, "position_ids": positions, "pixel_values": pixels,
             "image_grid_thw": grid}
    forward_backward([loaded.model], [batch], _square_loss)
    hf.zero_grad(set_to_none=True)
    hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
       mm_token_type_ids=types).logits.float().square().sum().backward()
    if not state.is_first_stage:
        return None
    theirs = {n[len("model."):]: p.grad for n, p in hf.named_parameters()
              if n.startswith(f"model.{VISUAL}.")}
    ours = {n: p.grad for n, p in loaded.model.named_parameters() if n.startswith(f"{VISUAL}.")}
    assert ours.keys() == theirs.keys() and all(g is not None for g in ours.values())
    scale = max(float(g.abs().max()) for g in theirs.values())
    return max(float((ours[n] - theirs[n]).abs().max()) for n in ours) / scale


def check_family(hf_dir: str, alias_dir, state, sp: bool) -> tuple:
    """(model_type, its report) of one checkpoint."""
    import torch
    from transformers import AutoModelForImageTextToText

    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.model.config import load_hf_config, model_shape
    from tests.distributed.workers.bridge_layouts import compare_export

    hf_config = load_hf_config(hf_dir)
    model_type = model_shape(hf_config).model_type
    loaded = load_mcore_model(hf_config, model_type, torch.float32, state, hf_dir=hf_dir,
                              sequence_parallel=sp)
    result = {"export": compare_export(loaded, hf_dir)}
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
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
    contiguous = contiguous_mrope_logits(loaded, state, ids, positions, pixels, grid)
    if contiguous is not None:
        result["logits"]["control_contiguous_mrope"] = diff(contiguous, reference)
    shallow = no_deepstack_logits(loaded, state, hf_config, ids, positions, pixels, grid)
    if shallow is not None:
        result["logits"]["control_no_deepstack"] = diff(shallow, reference)
    result["logits"]["cached_tower"], result["cached_tower_runs"] = cached_tower_logits(
        loaded, state, ids, positions, pixels, grid, ours)
    result["vision_grad_rel_diff"] = vision_gradients(loaded, state, hf, ids, positions,
                                                      pixels, grid, types)
    if alias_dir:
        aliased = load_mcore_model(hf_config, model_type, torch.float32, state,
                                   hf_dir=alias_dir)
        result["alias_export"] = compare_export(aliased, hf_dir)
    return model_type, result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--hf_dir", nargs="+", required=True)
    parser.add_argument("--alias_dir", nargs="+", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    args = parser.parse_args()

    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(tp=args.tp, pp=args.pp, device="cpu", seed=0)
    aliases = args.alias_dir or [None] * len(args.hf_dir)
    result = dict(check_family(hf_dir, alias, state, args.sp)
                  for hf_dir, alias in zip(args.hf_dir, aliases))
    with open(os.path.join(args.out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
