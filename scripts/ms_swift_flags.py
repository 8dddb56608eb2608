"""How many of ms-swift's `megatron rlhf` arguments `megatron rlhf` accepts, refuses with a
reason, or does not know, over the list in tests/data/ms_swift_rlhf_flags.txt.

    python scripts/ms_swift_flags.py                  # the three counts and the unknown names
    python scripts/ms_swift_flags.py --derive DIR     # rewrite the list from an ms-swift git dir

The list is derived from ms-swift's source (a git directory at COMMIT) without importing it:
every annotated class attribute (a dataclass field) of MegatronRLHFArguments and of its base
classes, found by name in swift/megatron/arguments, swift/arguments and swift/ray_utils, minus
the names of EXCLUDED, each under its rule. tests/unit/test_ms_swift_flag_count.py runs
`classify` on it.
"""
import argparse
import ast
import os
import subprocess
import sys
from typing import Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LIST = os.path.join(REPO, "tests", "data", "ms_swift_rlhf_flags.txt")
COMMIT = "3602360a562313afbf2ef6065fdf61f271a2c5b9"
ROOT_CLASS = "MegatronRLHFArguments"
SOURCE_DIRS = ("swift/megatron/arguments", "swift/arguments", "swift/ray_utils")

RULES = {
    "private": "a private field (leading underscore), not a command-line flag",
    "other_rlhf_type": "read only by ms-swift's trainers of another --rlhf_type or task (DPO, KTO, "
                       "reward model, GKD, sequence classification, embedding, SFT losses): "
                       "`git grep` finds them in swift/megatron/trainers/{dpo,kto,reward,gkd,"
                       "embedding}_trainer.py or trainer.py's SFT loss only",
    "not_megatron": "read by no code of ms-swift's Megatron mode (bitsandbytes/HQQ quantization "
                    "of transformers models, beam search and streaming of `swift infer`)",
}
EXCLUDED = {
    "_teacher_use_disable_adapter": "private",
    **{name: "other_rlhf_type" for name in (
        "rpo_alpha", "reference_free", "label_smoothing", "f_divergence_type", "desirable_weight",
        "undesirable_weight", "calculate_KL", "center_rewards_coefficient", "gkd_logits_topk",
        "lmbda", "seq_kd", "sft_alpha", "num_labels", "problem_type", "mrl_dims",
        "enable_dft_loss", "enable_channel_loss")},
    **{name: "not_megatron" for name in (
        "quant_method", "quant_bits", "hqq_axis", "bnb_4bit_compute_dtype", "bnb_4bit_quant_type",
        "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage", "num_beams", "stream", "logprobs",
        "top_logprobs")},
}


# ---- deriving the list from ms-swift's source --------------------------------------------------

def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "-C", git_dir, *args], capture_output=True, text=True,
                          check=True).stdout


def _classes(git_dir: str) -> Dict[str, Tuple[List[str], List[str]]]:
    """{class name: (base names, annotated attribute names)} over SOURCE_DIRS at COMMIT."""
    classes = {}
    for path in _git(git_dir, "ls-tree", "-r", "--name-only", COMMIT, *SOURCE_DIRS).split():
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(_git(git_dir, "show", f"{COMMIT}:{path}"))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                names = [s.target.id for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                classes.setdefault(node.name, (bases, names))
    return classes


def derive(git_dir: str) -> List[str]:
    """Every field name of ROOT_CLASS and its bases (depth first, as declared), each once."""
    classes, seen, order = _classes(git_dir), set(), []

    def visit(name):
        if name in classes and name not in seen:
            seen.add(name)
            order.append(name)
            for base in classes[name][0]:
                visit(base)
    visit(ROOT_CLASS)
    return list(dict.fromkeys(field for cls in order for field in classes[cls][1]))


def render(names: List[str]) -> str:
    kept = [n for n in names if n not in EXCLUDED]
    lines = [f"# ms-swift's `megatron rlhf` arguments that a Megatron GRPO user can pass: ms-swift "
             f"commit {COMMIT}.",
             "# Derived by `python scripts/ms_swift_flags.py --derive <ms-swift git dir>`: every "
             f"dataclass field of {ROOT_CLASS}",
             f"# and its base classes ({len(names)} names), minus {len(names) - len(kept)} "
             "excluded by these rules (listed at the end):"]
    lines += [f"#   {rule}: {text}" for rule, text in RULES.items()]
    lines += kept
    for rule in RULES:
        lines.append(f"# excluded, {rule}: " + " ".join(n for n in names if EXCLUDED.get(n) == rule))
    return "\n".join(lines) + "\n"


# ---- classifying the list with our parser ------------------------------------------------------

def read_list(path: str = LIST) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def classify(names: List[str]) -> Dict[str, List[str]]:
    """{"accepted": [...], "refused": [...], "unknown": [...]}: a flag (or alias) of `megatron
    rlhf`; a name the unknown-flag error answers with a reason or the flag to use; neither."""
    from swift_megatron.arguments import ms_swift
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import _aliases, _all_specs

    known = _aliases(_all_specs(RlhfArguments))
    result = {"accepted": [], "refused": [], "unknown": []}
    for name in names:
        kind = "accepted" if name in known else "refused" if ms_swift.explain(name) else "unknown"
        result[kind].append(name)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--derive", metavar="GIT_DIR", help="rewrite the list from ms-swift's "
                        f"source at commit {COMMIT[:8]} in this git directory")
    args = parser.parse_args(argv)
    if args.derive:
        with open(LIST, "w", encoding="utf-8") as f:
            f.write(render(derive(args.derive)))
    result = classify(read_list())
    print(f"{sum(map(len, result.values()))} ms-swift arguments: "
          + ", ".join(f"{len(v)} {k}" for k, v in result.items()))
    print("unknown:", " ".join(result["unknown"]))


if __name__ == "__main__":
    main()
