"""ms-swift multimodal rows -> Qwen2.5-VL inputs (data/images.py, data/prompts.py): image loading
from paths, bytes, datasets dicts and URLs (a local HTTP server), `<image>` tags (added when
missing, counted), expansion to the processor's number of image tokens, 3-D positions equal to
transformers', GRPO prompts built from image rows (errors name the row), --max_pixels /
MAX_PIXELS, and the micro-batch's 3-D positions (padded and packed) equal to transformers'
for prompt + completion."""
import http.server
import io
import json
import re
import threading
from functools import partial

import pytest
import torch
from PIL import Image

from swift_megatron.data.images import (ImageEncoder, check_image, expand_image_tags, load_image,
                                        mrope_position_ids, process_images, resolve_max_pixels,
                                        tag_images)
from swift_megatron.data.prompts import PromptSettings, RowError, build_prompts
from swift_megatron.errors import UserError


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
                                         ("http://127.0.0.1:9/y.png", "could not be downloaded"),
                                         (3, "must be a path")])
def test_bad_images_are_refused(value, match):
    with pytest.raises(RowError, match=match):
        load_image(value)


def test_images_are_checked_without_decoding(tmp_path):
    """check_image (the dry run's) accepts what load_image reads, without fetching URLs, and
    refuses a missing file, a non-image, a damaged PNG and other types, as load_image does."""
    good, broken = tmp_path / "red.png", tmp_path / "broken.png"
    good.write_bytes(_png())
    broken.write_bytes(_png()[:40])
    for value in (str(good), _png(), {"bytes": None, "path": str(good)}, Image.new("RGB", (4, 4)),
                  "http://127.0.0.1:9/not-fetched.png"):
        check_image(value)
    for value, match in (("/nowhere/x.png", "'/nowhere/x.png' does not exist"),
                         (str(broken), f"image {broken} is unreadable"),
                         (b"not an image", "image of 12 bytes is unreadable"), (3, "got int"),
                         ({"path": None}, "an image dict needs 'bytes' or 'path'")):
        with pytest.raises(RowError, match=re.escape(match)):
            check_image(value)
        with pytest.raises(RowError, match=re.escape(match)):
            load_image(value)


def test_tags_are_added_when_missing_and_counted_otherwise():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Colour?"}]
    assert tag_images(messages, 2)[1]["content"] == "<image><image>Colour?"
    assert messages[1]["content"] == "Colour?"   # not modified in place
    tagged = [{"role": "user", "content": "a <image> b"}]
    assert tag_images(tagged, 1) is tagged
    with pytest.raises(RowError, match="1 <image> tag\\(s\\) for 2 image"):
        tag_images(tagged, 2)


@pytest.mark.parametrize("family, patch, grids", [
    ("qwen2_5_vl", 14, [[1, 4, 4], [1, 8, 8]]),
    ("qwen3_5", 16, [[1, 4, 4], [1, 6, 6]])])   # 16-pixel patches: 112x112 -> 96x96
def test_expansion_and_positions_follow_the_processor(tmp_path, family, patch, grids):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from swift_megatron.fixtures import build_tiny_model

    model_dir = build_tiny_model(family, str(tmp_path / family), images=True)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    images = [load_image(_png(size=(60, 50))), load_image(_png((0, 0, 255), size=(112, 112)))]
    inputs = process_images(processor, images)
    assert inputs["image_grid_thw"].tolist() == grids
    patches = sum(t * h * w for t, h, w in grids)
    assert inputs["pixel_values"].shape == (patches, 3 * 2 * patch * patch)
    text = expand_image_tags("A<image>B<image>C", inputs["image_grid_thw"], 2)
    assert text.count("<|image_pad|>") == patches // 4 and text.startswith("A<|vision_start|>")
    with pytest.raises(RowError, match="1 <image> tag"):
        expand_image_tags("A<image>", inputs["image_grid_thw"], 2)

    config = json.load(open(f"{model_dir}/config.json"))
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids
    pad = config["image_token_id"]
    assert int((ids == pad).sum()) == patches // 4
    ours = mrope_position_ids(config, ids, pad, inputs["image_grid_thw"])
    hf = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert type(hf).__name__.lower().startswith(family)   # the family's own class
    theirs, _ = hf.model.get_rope_index(ids, (ids == pad).int(),
                                        image_grid_thw=inputs["image_grid_thw"])
    assert ours.shape == (3, 1, ids.shape[1]) and torch.equal(ours, theirs)
    assert int(ours.max()) < ids.shape[1] - 1   # images advance positions by their grid only


def test_a_text_model_refuses_image_rows_naming_the_row():
    from swift_megatron.fixtures import load_tokenizer

    rows = [{"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "<image>hi"}], "images": ["a.png"]}]
    with pytest.raises(Exception, match="row 2: it has images, but the model takes text only"):
        build_prompts(rows, load_tokenizer(), PromptSettings(max_prompt_length=64), spec="d.jsonl")


def test_urls_are_downloaded(tmp_path):
    (tmp_path / "red.png").write_bytes(_png())
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        image = load_image(f"http://127.0.0.1:{server.server_address[1]}/red.png")
    finally:
        server.shutdown()
    assert image.size == (60, 50) and image.getpixel((0, 0)) == (255, 0, 0)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(model dir, tokenizer, ImageEncoder) of the tiny Qwen2.5-VL."""
    from transformers import AutoTokenizer

    from swift_megatron.fixtures import build_tiny_model

    model_dir = build_tiny_model("qwen2_5_vl", str(tmp_path_factory.mktemp("vl") / "m"))
    config = json.load(open(f"{model_dir}/config.json"))
    return model_dir, AutoTokenizer.from_pretrained(model_dir), ImageEncoder(model_dir, config)


def test_image_rows_become_prompts_with_expanded_tags(vl, tmp_path):
    model_dir, tok, encoder = vl
    path = tmp_path / "a.png"
    path.write_bytes(_png(size=(112, 112)))
    rows = [{"messages": [{"role": "user", "content": "Colour?"}], "images": [str(path)],
             "solution": "red"},
            {"messages": [{"role": "user", "content": "<image> and <image>?"}],
             "images": [{"bytes": _png(), "path": None}, _png((0, 0, 255))], "solution": "x"},
            {"query": "text only", "solution": "y"}]
    prompts = build_prompts(rows, tok, PromptSettings(max_prompt_length=200), images=encoder)
    pad = encoder.image_token_id
    assert prompts[0].messages[-1]["content"] == "<image>Colour?"   # the tag is prepended
    assert prompts[0].image_grid_thw == [[1, 8, 8]] and prompts[0].input_ids.count(pad) == 16
    assert prompts[1].image_grid_thw == [[1, 4, 4], [1, 4, 4]] and prompts[1].input_ids.count(pad) == 8
    assert prompts[2].images is None and pad not in prompts[2].input_ids
    assert [p.columns["solution"] for p in prompts] == ["red", "x", "y"]   # for the rewards
    assert prompts[0].input_ids == tok(prompts[0].text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("row,match", [
    ({"messages": [{"role": "user", "content": "<image>"}], "images": [b"junk"]}, "unreadable"),
    ({"messages": [{"role": "user", "content": "<image><image>"}], "images": [b"x"]},
     "2 <image> tag\\(s\\) for 1 image"),
    ({"query": "q", "images": ["/nowhere.png"]}, "does not exist"),
    ({"query": "<video>q", "videos": ["v.mp4"]}, "it has videos, which are not supported")])
def test_bad_image_rows_name_the_row(vl, row, match):
    _, tok, encoder = vl
    rows = [{"query": "fine"}, row]
    with pytest.raises(UserError, match=f"dataset d.jsonl row 2: .*{match}"):
        build_prompts(rows, tok, PromptSettings(max_prompt_length=200), spec="d.jsonl",
                      images=encoder)


def test_image_prompts_are_never_cut(vl):
    _, tok, encoder = vl
    rows = [{"query": "q", "images": [_png(size=(112, 112))]}]
    with pytest.raises(UserError, match="row 1: .*image tokens cannot be cut"):
        build_prompts(rows, tok, PromptSettings(max_prompt_length=10), images=encoder)
    kept = build_prompts(rows + [{"query": "q"}], tok,
                         PromptSettings(max_prompt_length=10, truncation_strategy="delete"),
                         images=encoder)
    assert len(kept) == 1 and kept[0].images is None


def test_max_pixels_flag_and_environment(vl, monkeypatch):
    model_dir, _, encoder = vl
    monkeypatch.delenv("MAX_PIXELS", raising=False)
    assert resolve_max_pixels(None) is None and resolve_max_pixels(3136) == 3136
    monkeypatch.setenv("MAX_PIXELS", "3136")
    assert resolve_max_pixels(None) == 3136 and resolve_max_pixels(6000) == 6000
    monkeypatch.setenv("MAX_PIXELS", "big")
    with pytest.raises(UserError, match="MAX_PIXELS='big'"):
        resolve_max_pixels(None)
    big = [_png(size=(112, 112))]
    assert encoder.encode(big)["image_grid_thw"].tolist() == [[1, 8, 8]]
    small = ImageEncoder(model_dir, json.load(open(f"{model_dir}/config.json")), 56 * 56)
    assert small.encode(big)["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize("packed", [False, True])
def test_micro_batch_positions_equal_transformers(vl, packed):
    """Two samples (image prompt, text prompt) with completions: the micro-batch's 3-D ids
    equal get_rope_index of each whole sequence (what transformers' generation uses)."""
    from swift_megatron.rlhf.grpo.batch import Sample, collate
    from swift_megatron.rlhf.grpo.collect import attach_images

    _, tok, encoder = vl
    prompts = build_prompts([{"query": "Colour?", "images": [_png(size=(112, 84))]},
                             {"query": "Just text, a bit longer than the other"}], tok,
                            PromptSettings(max_prompt_length=200), images=encoder)
    samples = []
    for prompt, completion in zip(prompts, ([5, 6, 7, 8], [9, 10])):
        sample = Sample(group_id=0, prompt_id=0, prompt_ids=prompt.input_ids,
                        completion_ids=completion, rollout_logprobs=None, finish_reason="stop",
                        rewards=[])
        if prompt.images:
            inputs = encoder.encode(prompt.images)
            inputs["positions"] = encoder.positions(prompt.input_ids, inputs["image_grid_thw"])
            attach_images(sample, inputs)
        samples.append(sample)
    micro = collate(samples, pad_id=0, packed=packed, pad_to_multiple=8)
    assert torch.equal(micro["image_grid_thw"], samples[0].image_grid_thw)
    assert torch.equal(micro["pixel_values"], samples[0].pixel_values)
    for row, sample in enumerate(samples):
        ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
        grid = sample.image_grid_thw
        expected = mrope_position_ids(None, ids, encoder.image_token_id, grid,
                                      model=encoder._rope)[:, 0, :-1]
        n = expected.shape[1]
        prompt = torch.arange(n) < len(sample.prompt_ids)
        if packed:
            start = int(micro["cu_seqlens"][row])
            got = micro["position_ids"][:, 0, start:start + n]
            assert torch.equal(micro["tokens"][0, start:start + n], ids[0, :-1])
            assert torch.equal(micro["prompt_mask"][0, start:start + n], prompt)
        else:
            got = micro["position_ids"][:, row, :n]
            assert torch.equal(micro["prompt_mask"][row, :n], prompt)
            assert not micro["prompt_mask"][row, n:].any()   # right padding
        assert torch.equal(got, expected), row
    assert micro["prompt_mask"].shape == micro["tokens"].shape
    assert bool((expected[0] == expected[1]).all())   # the text sample: equal axes


def test_prompt_tokens_equal_the_models_own_processor(vl):
    """Our expansion (image processor + tags) gives the token ids transformers' AutoProcessor
    gives for the same text and images (it also builds a video processor: needs torchvision,
    which scripts/install_cpu_vllm.sh makes importable)."""
    from transformers import AutoProcessor

    model_dir, tok, encoder = vl
    images = [_png(size=(112, 84)), _png((0, 0, 255))]
    prompt = build_prompts([{"query": "<image> vs <image>?", "images": images}], tok,
                           PromptSettings(max_prompt_length=200), images=encoder)[0]
    one_pad = prompt.text
    for grid in prompt.image_grid_thw:
        one_pad = one_pad.replace("<|image_pad|>" * (grid[1] * grid[2] // 4), "<|image_pad|>", 1)
    processor = AutoProcessor.from_pretrained(model_dir)
    theirs = processor(text=[one_pad], images=[load_image(i) for i in images],
                       return_tensors="pt", add_special_tokens=False)
    assert theirs["input_ids"][0].tolist() == prompt.input_ids
    assert theirs["image_grid_thw"].tolist() == prompt.image_grid_thw


def test_precision_check_inputs_hold_one_image_per_sequence(tiny_model_dir):
    """`megatron export --test_convert_precision` on a vision-language model
    (precision_images.py): random ids below the vision tokens with one processed synthetic
    image per row (different pixels, different places), and the 3-D positions transformers
    gives them (they differ from 1-D positions inside the image only)."""
    from swift_megatron.export import random_tokens
    from swift_megatron.export.precision_images import image_inputs

    model_dir = tiny_model_dir("qwen2_5_vl")
    config = json.load(open(f"{model_dir}/config.json"))
    tokens = random_tokens(config["text_config"]["vocab_size"], 128, "cpu")
    inputs = image_inputs(model_dir, config, tokens)
    ids, pad = inputs.tokens, config["image_token_id"]
    assert ids.shape == (4, 64) and inputs.hf["image_grid_thw"].tolist() == [[1, 4, 6]] * 4
    assert (ids == pad).sum(1).tolist() == [6] * 4                     # 24 patches / 2x2 merge
    assert ((ids == config["vision_start_token_id"]).sum(1) == 1).all()
    starts = (ids == config["vision_start_token_id"]).int().argmax(1).tolist()
    assert len(set(starts)) == 4                                       # a different place each
    assert (ids >= config["vision_start_token_id"]).sum(1).tolist() == [8] * 4  # block only
    assert inputs.hf["pixel_values"].shape == (4 * 24, 3 * 2 * 14 * 14)
    first, second = inputs.hf["pixel_values"][:24], inputs.hf["pixel_values"][24:48]
    assert not torch.equal(first, second)                              # a different image each
    assert torch.equal(inputs.hf["mm_token_type_ids"], (ids == pad).int())
    positions = inputs.mcore["position_ids"]
    assert positions.shape == (3, 4, 64)
    flat = torch.arange(64).expand(4, 64)
    inside = (ids == pad)
    assert not torch.equal(positions[1][inside], flat[inside])         # height/width axes
    before = starts[0] + 1                                             # text, then vision_start
    assert torch.equal(positions[:, 0, :before], flat[0, :before].expand(3, -1))


@pytest.fixture
def trainer_world(single_process_group):
    """The one-process world for a GRPOTrainer that stops in its constructor, after it set up
    megatron's model-parallel groups: released afterwards, or a later test of this process
    finds them initialized (the world itself is single_process_group's)."""
    yield single_process_group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def test_a_run_refuses_a_bad_image_before_building_the_model(vl, tmp_path, monkeypatch,
                                                             trainer_world):
    """issue 40: a row's missing image stops the run while the prompts are built, naming the
    row and the file, before any model (the policy here) is built."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.preflight import preflight_rlhf
    from swift_megatron.rlhf.grpo import components
    from swift_megatron.rlhf.grpo.trainer import GRPOTrainer

    (tmp_path / "red.png").write_bytes(_png())
    rows = [{"messages": [{"role": "user", "content": "Colour?"}], "images": [str(image)],
             "solution": "red"} for image in (tmp_path / "red.png", tmp_path / "gone.png")]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = parse_command(RlhfArguments, [
        "--model", vl[0], "--dataset", str(tmp_path / "d.jsonl"), "--reward_funcs", "accuracy",
        "--num_generations", "2", "--global_batch_size", "4", "--micro_batch_size", "2",
        "--max_completion_length", "8", "--device", "cpu", "--output_dir", str(tmp_path / "out")],
        "megatron rlhf")
    plan, _ = preflight_rlhf(args, world_size=1)
    monkeypatch.setattr(components, "policy", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UserError, match=re.escape(f"d.jsonl row 2: image "
                                                  f"'{tmp_path / 'gone.png'}' does not exist")):
        GRPOTrainer(args, plan)


def test_unsupported_image_runs_stop_before_the_model(vl, tmp_path, monkeypatch,
                                                      trainer_world):
    """issue 40: images with a multi-turn scheduler (as with --context_parallel_size > 1) are
    refused before the model is built (it came after the model and the rollout engine)."""
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.preflight import preflight_rlhf
    from swift_megatron.rlhf.grpo import components
    from swift_megatron.rlhf.grpo.trainer import GRPOTrainer

    (tmp_path / "red.png").write_bytes(_png())
    row = {"messages": [{"role": "user", "content": "Colour?"}],
           "images": [str(tmp_path / "red.png")], "solution": "red"}
    (tmp_path / "d.jsonl").write_text((json.dumps(row) + "\n") * 2)
    args = parse_command(RlhfArguments, [
        "--model", vl[0], "--dataset", str(tmp_path / "d.jsonl"), "--reward_funcs", "accuracy",
        "--num_generations", "2", "--global_batch_size", "4", "--micro_batch_size", "2",
        "--max_completion_length", "8", "--device", "cpu", "--output_dir", str(tmp_path / "out"),
        "--multi_turn_scheduler", "calculator"], "megatron rlhf")
    plan, _ = preflight_rlhf(args, world_size=1)
    monkeypatch.setattr(components, "policy", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UserError, match="multi-turn rollouts with images are not supported"):
        GRPOTrainer(args, plan)
