"""Images of ms-swift's multimodal rows, for Qwen2.5-VL and Qwen3.5: rows -> model inputs (pure
helpers).

A row's `images` column lists local paths, raw bytes, `{"bytes": ..., "path": ...}` dicts (the
Hugging Face datasets Image feature) or PIL images; each `<image>` tag in the messages marks
where one goes, in order, and tags are prepended to the first user message when a row has none
(as ms-swift's template does). The model directory's image processor (`AutoImageProcessor`,
Qwen2-VL's) turns images into `pixel_values` and `image_grid_thw`; each tag becomes
`<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>`, as the processor's
chat template expands it; `mrope_position_ids` gives the 3-D M-RoPE ids with the family's own
transformers `get_rope_index` (config only, no weights). Errors name the row (`RowError`).
`http(s)://` URLs are downloaded (as ms-swift does). `check_image` checks a value cheaply
(type, file, header: no pixels decoded) for the dry run's row checks. `ImageEncoder` bundles
these for the trainer: a prompt's images -> pixels, and its tokens -> 3-D positions.

The image processor is transformers' `AutoImageProcessor`, not `AutoProcessor`: the latter also
builds Qwen2-VL's video processor, which needs torchvision; the tag expansion here gives the
token count the full processor's `<|image_pad|>` expansion gives (tested).
"""
import contextlib
import io
import os
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from swift_megatron.data.prompts import RowError
from swift_megatron.errors import UserError

IMAGE_TAG = "<image>"
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


def load_image(value: Any):
    """An RGB PIL image from a path, URL, bytes, a datasets Image dict or a PIL image."""
    from PIL import Image

    value = _image_source(value)
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if _is_url(value):
        value = _download(value)
    with _opened(value) as image:
        return image.convert("RGB")


def check_image(value: Any) -> None:
    """RowError unless load_image can read `value`, checked cheaply (before anything loads): its
    type, the file's existence, and its header and structure (PIL's verify, which decodes no
    pixels). URLs are not fetched here."""
    from PIL import Image

    value = _image_source(value)
    if not (isinstance(value, Image.Image) or _is_url(value)):
        with _opened(value) as image:
            image.verify()


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def _image_source(value: Any):
    """The path, URL, bytes or PIL image a row's image value holds (a datasets Image dict: its
    bytes, else its path); RowError for any other type and for a missing file."""
    from PIL import Image

    if isinstance(value, dict):
        held = value.get("bytes") or value.get("path")
        if not held:
            raise RowError(f"an image dict needs 'bytes' or 'path', got the keys {sorted(value)}")
        value = held
    if isinstance(value, str) and not _is_url(value) and not os.path.isfile(value):
        raise RowError(f"image {value!r} does not exist")
    if not isinstance(value, (str, bytes, Image.Image)):
        raise RowError(f"an image must be a path, bytes or a PIL image, got {type(value).__name__}")
    return value


@contextlib.contextmanager
def _opened(value: Union[str, bytes]):
    """The PIL image a path or bytes hold (lazily opened); RowError naming it when it is not
    one, or is damaged (OSError, ValueError, or the SyntaxError of PIL's verify)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(value) if isinstance(value, bytes) else value) as image:
            yield image
    except (OSError, ValueError, SyntaxError) as error:
        name = value if isinstance(value, str) else f"of {len(value)} bytes"
        raise RowError(f"image {name} is unreadable: {error}") from None


def _download(url: str, timeout: float = 60.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except (OSError, ValueError) as error:
        raise RowError(f"image {url!r} could not be downloaded: {error}") from None


def one_pad_per_image(ids: Sequence[int], image_token_id: int) -> List[int]:
    """Token ids with each run of image pads cut to one, the prompt form vLLM expands itself
    (two images' runs are apart: each sits between its vision start and end tokens)."""
    return [t for i, t in enumerate(ids) if not (t == image_token_id and i and
                                                 ids[i - 1] == image_token_id)]


def png_base64(image) -> str:
    """A PIL image as base64 PNG text (lossless: the same pixels arrive), for JSON requests."""
    import base64

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def tag_images(messages: List[Dict[str, Any]], count: int) -> List[Dict[str, Any]]:
    """Messages with exactly `count` `<image>` tags: unchanged when they already have that many,
    tags prepended to the first user message when they have none; RowError otherwise."""
    tags = sum(str(m.get("content", "")).count(IMAGE_TAG) for m in messages)
    if tags == count:
        return messages
    if tags:
        raise RowError(f"its messages hold {tags} {IMAGE_TAG} tag(s) for {count} image(s)")
    user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if user is None:
        raise RowError(f"it has {count} image(s) but no user message to put them in")
    tagged = [dict(m) for m in messages]
    tagged[user]["content"] = IMAGE_TAG * count + tagged[user]["content"]
    return tagged


def expand_image_tags(text: str, image_grid_thw, merge_size: int) -> str:
    """Each `<image>` of the rendered prompt -> vision start, one pad per merged patch, end."""
    parts = text.split(IMAGE_TAG)
    if len(parts) - 1 != len(image_grid_thw):
        raise RowError(f"the rendered prompt holds {len(parts) - 1} {IMAGE_TAG} tag(s) for "
                       f"{len(image_grid_thw)} image(s)")
    out = parts[0]
    for grid, rest in zip(image_grid_thw, parts[1:]):
        tokens = int(grid[0] * grid[1] * grid[2]) // merge_size ** 2
        out += VISION_START + IMAGE_PAD * tokens + VISION_END + rest
    return out


def process_images(processor: Any, images: Sequence[Any]) -> Dict[str, Any]:
    """`pixel_values` [patches, C*T*P*P] and `image_grid_thw` [images, 3] of PIL images."""
    out = processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def rope_index_model(hf_config: Any):
    """transformers' model of the family (Qwen2_5_VLModel, Qwen3_5Model, ...) on the meta device
    (no weights): its `get_rope_index`. `hf_config`: a config.json dict or config object."""
    import torch

    from swift_megatron.model.vision import full_hf_config, hf_class

    config = full_hf_config(hf_config)
    with torch.device("meta"):
        return hf_class(config.model_type, "model")(config)


def mrope_position_ids(hf_config: Any, input_ids, image_token_id: int, image_grid_thw=None, *,
                       model=None):
    """[3, b, s] M-RoPE ids of token ids [b, s] holding images of `image_grid_thw`, from
    the family's transformers `get_rope_index` (`model`: a rope_index_model to reuse)."""
    model = model if model is not None else rope_index_model(hf_config)
    positions, _ = model.get_rope_index(input_ids, (input_ids == image_token_id).int(),
                                        image_grid_thw=image_grid_thw)
    return positions


def resolve_max_pixels(flag: Optional[int]) -> Optional[int]:
    """--max_pixels, else the MAX_PIXELS environment variable (ms-swift's), else None (the
    model's image processor keeps its own max_pixels)."""
    if flag is not None:
        return flag
    env = os.environ.get("MAX_PIXELS")
    if env is None or not env.strip():
        return None
    try:
        return int(env)
    except ValueError:
        raise UserError(f"MAX_PIXELS={env!r} must be an integer number of pixels") from None


class ImageEncoder:
    """A vision-language model's image side for prompts: the model directory's image processor
    (its max_pixels replaced by `max_pixels` when given) and the config's image token and 3-D
    positions."""

    def __init__(self, model_dir: str, hf_config: Mapping[str, Any],
                 max_pixels: Optional[int] = None):
        from transformers import AutoImageProcessor

        extra = {} if max_pixels is None else {"max_pixels": int(max_pixels)}
        self.processor = AutoImageProcessor.from_pretrained(model_dir, **extra)
        self.merge_size = int(self.processor.merge_size)
        self.image_token_id = int(hf_config["image_token_id"])
        self._rope = rope_index_model(hf_config)

    def encode(self, values: Sequence[Any]) -> Dict[str, Any]:
        """`images` (RGB PIL), `pixel_values` and `image_grid_thw` of a row's image values."""
        images = [load_image(value) for value in values]
        return {"images": images, **process_images(self.processor, images)}

    tag = staticmethod(tag_images)

    def expand(self, text: str, image_grid_thw) -> str:
        return expand_image_tags(text, image_grid_thw, self.merge_size)

    def positions(self, input_ids: Sequence[int], image_grid_thw):
        """[3, len(input_ids)] M-RoPE ids of one prompt."""
        import torch

        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        return mrope_position_ids(None, ids, self.image_token_id, image_grid_thw,
                                  model=self._rope)[:, 0]
