"""The inputs of `megatron export --test_convert_precision` for a vision-language model.

The text check's seeded random token ids get one synthetic image per sequence (seeded random
pixels, a different image in each row, at a different place), encoded by the image processor
of the reference HF directory (data/images.py's ImageEncoder, as for training): its
`<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>` replace tokens of
the row, and the other ids are kept below the vision special tokens. Each side then gets the
inputs it takes: transformers `pixel_values`, `image_grid_thw` and `mm_token_type_ids` (it
computes the 3-D M-RoPE positions itself); the Megatron model the same pixels and grids with
the 3-D positions of transformers' `get_rope_index`.
"""
import dataclasses
from typing import Any, Dict, Mapping

from swift_megatron.errors import UserError

IMAGE_SIZE = (56, 84)   # height, width: a 4 x 6 grid of 14-pixel patches, 6 merged image tokens


@dataclasses.dataclass
class ImageInputs:
    tokens: Any              # [b, s] token ids with one image block per row
    hf: Dict[str, Any]       # transformers keywords besides input_ids
    mcore: Dict[str, Any]    # Megatron micro-batch entries besides tokens


def synthetic_image(seed: int):
    """A seeded RGB image of IMAGE_SIZE with random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _encoder(hf_dir: str, hf_config: Mapping[str, Any]):
    from swift_megatron.data.images import ImageEncoder

    try:
        return ImageEncoder(hf_dir, hf_config)
    except OSError as error:
        raise UserError(f"--test_convert_precision runs a vision-language model with an image, "
                        f"through the image processor of {hf_dir}, which has none "
                        f"(preprocessor_config.json): {error}") from None


def image_inputs(hf_dir: str, hf_config: Mapping[str, Any], tokens) -> ImageInputs:
    """`tokens` [b, s] (random ids) with an image in each row, and both sides' inputs."""
    import torch

    encoder = _encoder(hf_dir, hf_config)
    rows, length = tokens.shape
    encoded = encoder.encode([synthetic_image(row) for row in range(rows)])
    grid = encoded["image_grid_thw"]
    pad = encoder.image_token_id
    start, end = int(hf_config["vision_start_token_id"]), int(hf_config["vision_end_token_id"])
    block = torch.tensor([start] + [pad] * (int(grid[0].prod()) // encoder.merge_size ** 2) + [end])
    if block.numel() >= length:
        raise UserError(f"--test_convert_precision: an image of {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} "
                        f"pixels takes {block.numel()} tokens, more than the {length} of a test "
                        "sequence (max_position_embeddings)")
    lowest_special = min(start, end, pad, int(hf_config.get("video_token_id", pad)))
    ids = tokens.cpu() % lowest_special
    for row in range(rows):
        at = 1 + (5 * row) % (length - block.numel())
        ids[row, at:at + block.numel()] = block
    positions = torch.stack([encoder.positions(ids[row].tolist(), grid[row:row + 1])
                             for row in range(rows)], dim=1)          # [3, b, s]
    device = tokens.device
    pixels, grid = encoded["pixel_values"].to(device), grid.to(device)
    ids = ids.to(device)
    return ImageInputs(
        tokens=ids,
        hf={"pixel_values": pixels, "image_grid_thw": grid,
            "mm_token_type_ids": (ids == pad).int()},
        mcore={"position_ids": positions.to(device), "pixel_values": pixels,
               "image_grid_thw": grid})
