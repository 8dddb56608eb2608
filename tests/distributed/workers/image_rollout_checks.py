"""Worker: GRPO's image path on tiny vision-language models (Qwen2.5-VL, Qwen3.5 with its vision
tower; one result per `--hf_dir`, by model_type), from dataset rows to the trainer's logprobs.

For each model, builds prompts from the first red and blue rows of a colour dataset (fixtures
`build_colour_dataset`) plus a text-only prompt, samples completions with the embedded engine
(transformers' whole model, given each prompt's pixels, in one left-padded batch; weights pushed
from the bridge's export, as the trainer does), and computes
the trainer's logprobs of those tokens with the Megatron model through the micro-batch path
(collate: pixel values, grids and 3-D positions; padded and packed; megatron's schedule). Reports
the max |engine - trainer| over completion tokens, and the same with the two images' pixels
swapped in the micro-batch (control: the logprobs depend on the pixels), and how much the
logprobs of a completion change when it samples the image token id once more (it must stay a
plain token: nothing before it changes). Writes
{out_dir}/rank{R}.json.
"""
import argparse
import dataclasses
import functools
import json
import os


def trainer_logprobs(loaded, state, micro: dict, vocab: int):
    """[B, S] logprobs of micro["targets"] from the Megatron model (last stage; None elsewhere)."""
    import torch

    from swift_megatron.export.logits import _gathered_logits
    from swift_megatron.rlhf.grpo.batch import unpack
    from swift_megatron.training.step import forward_backward

    with torch.no_grad():
        out = forward_backward([loaded.model], [micro],
                               functools.partial(_gathered_logits, vocab), forward_only=True)
    if not state.is_last_stage:
        return None
    logprobs = torch.log_softmax(out[0]["logits"].float(), dim=-1)
    if "packed_index" in micro:
        packed = logprobs[0].gather(-1, micro["packed_targets"].unsqueeze(-1)).squeeze(-1)
        return unpack(packed, micro["packed_index"])
    return logprobs.gather(-1, micro["targets"].unsqueeze(-1)).squeeze(-1)


def max_diff(logprobs, micro) -> float:
    mask = micro["completion_mask"] > 0
    return float((logprobs - micro["rollout_logprobs"]).abs()[mask].max())


def check_model(hf_dir: str, dataset: str, state) -> tuple:
    """(model_type, its report) of one checkpoint."""
    import torch
    from transformers import AutoTokenizer

    from swift_megatron.data.images import ImageEncoder
    from swift_megatron.data.prompts import PromptSettings, build_prompts
    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.model.config import load_hf_config, model_shape
    from swift_megatron.rlhf.grpo.batch import Sample, collate
    from swift_megatron.rlhf.grpo.collect import attach_images
    from swift_megatron.rollout.engine import SamplingConfig
    from swift_megatron.rollout.hf import HFEngine

    hf_config = load_hf_config(hf_dir)
    model_type = model_shape(hf_config).model_type
    loaded = load_mcore_model(hf_config, model_type, torch.float32, state, hf_dir=hf_dir)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    encoder = ImageEncoder(hf_dir, hf_config)
    rows = [json.loads(line) for line in open(dataset)]
    rows = [next(r for r in rows if r["solution"] == c) for c in ("red", "blue")]
    prompts = build_prompts(rows + [{"query": "Say something longer than the image prompts do"}],
                            tok, PromptSettings(max_prompt_length=200), images=encoder)
    inputs = []
    for prompt in prompts:
        encoded = encoder.encode(prompt.images) if prompt.images else None
        if encoded is not None:
            encoded["positions"] = encoder.positions(prompt.input_ids, encoded["image_grid_thw"])
        inputs.append(encoded)

    engine = HFEngine(hf_dir, torch.device("cpu"), torch.float32, [tok.eos_token_id],
                      tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    engine.update_weights(loaded.bridge.export(loaded.model))
    completions = engine.generate([p.input_ids for p in prompts],
                                  SamplingConfig(max_tokens=8, temperature=1.0), [1, 2, 3],
                                  images=inputs)
    samples = [attach_images(Sample(group_id=i, prompt_id=i, prompt_ids=p.input_ids,
                                    completion_ids=c.token_ids, rollout_logprobs=c.logprobs,
                                    finish_reason=c.finish_reason, rewards=[]), inputs[i])
               for i, (p, c) in enumerate(zip(prompts, completions))]
    vocab = loaded.shape.vocab_size
    result = {"completion_lengths": [len(c.token_ids) for c in completions]}
    for layout, packed in (("padded", False), ("packed", True)):
        micro = collate(samples, pad_id=engine.pad, packed=packed, pad_to_multiple=4)
        ours = trainer_logprobs(loaded, state, micro, vocab)
        swapped = dict(micro, pixel_values=torch.cat([inputs[1]["pixel_values"],
                                                      inputs[0]["pixel_values"]]))
        other = trainer_logprobs(loaded, state, swapped, vocab)
        # a completion that samples the image token id: a plain token, not an image slot
        extra = [dataclasses.replace(samples[0], completion_ids=samples[0].completion_ids
                                     + [hf_config["image_token_id"]],
                                     rollout_logprobs=samples[0].rollout_logprobs + [0.0])]
        with_token = trainer_logprobs(loaded, state, collate(
            extra + samples[1:], pad_id=engine.pad, packed=packed, pad_to_multiple=4), vocab)
        if state.is_last_stage:
            n = len(samples[0].prompt_ids) + len(samples[0].completion_ids) - 1
            result[layout] = {"max_abs_diff": max_diff(ours, micro),
                              "control_swapped_pixels": max_diff(other, micro),
                              "text_row_swapped": float((other[2] - ours[2]).abs().max()),
                              "image_token_in_completion": float(
                                  (with_token[0, :n] - ours[0, :n]).abs().max())}
    return model_type, result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--hf_dir", nargs="+", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()

    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(pp=args.pp, device="cpu", seed=0)
    result = dict(check_model(hf_dir, args.dataset, state) for hf_dir in args.hf_dir)
    with open(os.path.join(args.out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
