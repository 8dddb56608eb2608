"""Write the tiny fixture checkpoints and the math dataset to a directory (offline, seconds).

    python scripts/make_tiny_models.py --output_dir DIR [--families llama qwen2 qwen3 qwen3_moe]
        [--dataset_rows N] [--image_dataset_rows N] [--seed S] [--dtype float32]
        [--retrain_tokenizer]

Writes DIR/<family>/ (config.json, model.safetensors, generation_config.json, tokenizer files)
per family (qwen2_5_vl, qwen3_vl and qwen3_5* also write their image processor) and
DIR/math.jsonl; with --image_dataset_rows also DIR/colours.jsonl and DIR/images/ (the image
task).
`--retrain_tokenizer` first retrains the byte-level BPE and rewrites
the committed swift_megatron/fixtures/data/tokenizer/ files (deterministic: the files only change
when the corpus or tokenizers' training changes).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swift_megatron.fixtures import (FAMILIES, build_colour_dataset,  # noqa: E402
                                     build_math_dataset, build_tiny_model)
from swift_megatron.fixtures.models import VISION_FAMILIES  # noqa: E402
from swift_megatron.fixtures.tokenizer import (  # noqa: E402
    TOKENIZER_DIR, train_tokenizer, write_tokenizer_files)
from swift_megatron.logging import get_logger  # noqa: E402

logger = get_logger("scripts.make_tiny_models")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--families", nargs="+", choices=FAMILIES + VISION_FAMILIES,
                        default=list(FAMILIES))
    parser.add_argument("--dataset_rows", type=int, default=64)
    parser.add_argument("--image_dataset_rows", type=int, default=0,
                        help="also write colours.jsonl, an image task (build_colour_dataset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--retrain_tokenizer", action="store_true",
                        help=f"retrain the BPE and rewrite {TOKENIZER_DIR}")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.retrain_tokenizer:
        tok = train_tokenizer()
        write_tokenizer_files(tok)
        logger.info("tokenizer retrained: %d tokens -> %s", tok.get_vocab_size(), TOKENIZER_DIR)
    for family in args.families:
        start = time.perf_counter()
        out = build_tiny_model(family, os.path.join(args.output_dir, family), seed=args.seed,
                               dtype=args.dtype)
        logger.info("%-9s -> %s (%.2fs)", family, out, time.perf_counter() - start)
    path = build_math_dataset(os.path.join(args.output_dir, "math.jsonl"), args.dataset_rows,
                              seed=args.seed)
    logger.info("dataset   -> %s (%d rows)", path, args.dataset_rows)
    if args.image_dataset_rows:
        path = build_colour_dataset(os.path.join(args.output_dir, "colours.jsonl"),
                                    args.image_dataset_rows, seed=args.seed)
        logger.info("images    -> %s (%d rows)", path, args.image_dataset_rows)


if __name__ == "__main__":
    main()
