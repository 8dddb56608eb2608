"""ms-swift multimodal rows -> Qwen2.5-VL inputs (data/images.py): image loading from paths,
bytes and datasets dicts, `<image>` tags (added when missing, counted), expansion to the
processor's number of image tokens, and 3-D positions equal to transformers'."""
import io
import json

import pytest
import torch
from PIL import Image

from swift_megatron.data.images import (expand_image_tags, load_image, mrope_position_ids,
                                        process_images, tag_images)
from swift_megatron.data.prompts import RowError, build_prompts


def _png(color=(255, 0, 0), size=(60, 50)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_images_load_from_path_bytes_and_dict(tmp_path):
    path = tmp_path / "red.png"
    path.write_bytes(_png())
    for value in (str(path), _png(), {"bytes": _png(), "path": None}, {"bytes": None, "path": str(path)}):
        image = load_image(value)
        assert image.mode == "RGB" and image.size == (60, 50)
        assert image.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("value,match", [("/nowhere/x.png", "does not exist"),
                                         (b"not an image", "unreadable"),
                                         ("https://x/y.png", "URLs are not supported"),
                                         (3, "must be a path")])
def test_bad_images_are_refused(value, match):
    with pytest.raises(RowError, match=match):
        load_image(value)


def test_tags_are_added_when_missing_and_counted_otherwise():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Colour?"}]
    assert tag_images(messages, 2)[1]["content"] == "<image><image>Colour?"
    assert messages[1]["content"] == "Colour?"   # not modified in place
    tagged = [{"role": "user", "content": "a <image> b"}]
    assert tag_images(tagged, 1) is tagged
    with pytest.raises(RowError, match="1 <image> tag\\(s\\) for 2 image"):
        tag_images(tagged, 2)


def test_expansion_and_positions_follow_the_processor(tiny_model_dir):
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model_dir = tiny_model_dir("qwen2_5_vl")
    processor = AutoImageProcessor.from_pretrained(model_dir)
    images = [load_image(_png(size=(60, 50))), load_image(_png((0, 0, 255), size=(112, 112)))]
    inputs = process_images(processor, images)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8]]
    assert inputs["pixel_values"].shape == (16 + 64, 3 * 2 * 14 * 14)
    text = expand_image_tags("A<image>B<image>C", inputs["image_grid_thw"], 2)
    assert text.count("<|image_pad|>") == 4 + 16 and text.startswith("A<|vision_start|>")
    with pytest.raises(RowError, match="1 <image> tag"):
        expand_image_tags("A<image>", inputs["image_grid_thw"], 2)

    config = json.load(open(f"{model_dir}/config.json"))
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids
    pad = config["image_token_id"]
    assert int((ids == pad).sum()) == 20
    ours = mrope_position_ids(config, ids, pad, inputs["image_grid_thw"])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    theirs, _ = hf.model.get_rope_index(ids, (ids == pad).int(),
                                        image_grid_thw=inputs["image_grid_thw"])
    assert ours.shape == (3, 1, ids.shape[1]) and torch.equal(ours, theirs)
    assert int(ours.max()) < ids.shape[1] - 1   # images advance positions by their grid only


def test_grpo_refuses_image_rows_naming_the_row():
    from swift_megatron.data.prompts import PromptSettings
    from swift_megatron.fixtures import load_tokenizer

    rows = [{"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "<image>hi"}], "images": ["a.png"]}]
    with pytest.raises(Exception, match="row 2: it has images"):
        build_prompts(rows, load_tokenizer(), PromptSettings(max_prompt_length=64), spec="d.jsonl")
