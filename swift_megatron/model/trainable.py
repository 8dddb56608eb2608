"""Which parameters train under ms-swift's freeze flags (--freeze_parameters, _regex, _ratio,
--trainable_parameters, _regex): pure functions of parameter names and sizes, shared by the
training (training/freeze.py applies them to the model) and the dry run's memory estimate.

The rules, in ms-swift's order: --freeze_parameters_ratio freezes the first parameters in model
order until that fraction of all elements is frozen; --freeze_parameters freezes the names
starting with a prefix, --freeze_parameters_regex those it matches (re.search); then
--trainable_parameters and --trainable_parameters_regex make names train again. Names are
Megatron's with global layer and expert numbers. On a model with tied embeddings the word
embedding and the output layer are one matrix: a rule that matches either name applies to it
(and to the output layer's copy on the last pipeline stage).

Unlike ms-swift, a prefix or expression that matches no parameter is an error, not a no-op.
"""
import bisect
import dataclasses
import re
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from swift_megatron.errors import UserError
from swift_megatron.model.memory import parameter_counts
from swift_megatron.model.text_config import text_config

EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
Table = Sequence[Tuple[str, int]]   # (global parameter name, elements), in model order


@dataclasses.dataclass(frozen=True)
class FreezeRules:
    """The freeze flags (arguments/freeze.py)."""

    freeze: Tuple[str, ...] = ()
    freeze_regex: Optional[str] = None
    ratio: float = 0.0
    trainable: Tuple[str, ...] = ()
    trainable_regex: Optional[str] = None

    @classmethod
    def from_arguments(cls, flags) -> "FreezeRules":
        return cls(tuple(flags.freeze_parameters), flags.freeze_parameters_regex,
                   flags.freeze_parameters_ratio, tuple(flags.trainable_parameters),
                   flags.trainable_parameters_regex)


def aliases(name: str, tied: bool) -> Tuple[str, ...]:
    """The names a rule may match for `name` (both ends of tied embeddings)."""
    if tied and name in (EMBEDDING, OUTPUT):
        return EMBEDDING, OUTPUT
    return (name,)


def _prefix_matches(prefix: str, names: Iterable[str], tied: bool) -> List[str]:
    return [n for n in names if any(a.startswith(prefix) for a in aliases(n, tied))]


def _regex_matches(pattern: Optional[str], names: Iterable[str], tied: bool) -> List[str]:
    if pattern is None:
        return []
    compiled = re.compile(pattern)
    return [n for n in names if any(compiled.search(a) for a in aliases(n, tied))]


def _by_ratio(table: Table, ratio: float, tied: bool) -> List[str]:
    """The first parameters in model order holding up to `ratio` of the elements (ms-swift's
    cut: bisect_right of the running sum); the tied output layer's copy is not counted twice,
    and is frozen with the embedding."""
    if not ratio:
        return []
    counted = [(n, size) for n, size in table if not (tied and n == OUTPUT)]
    running, total = [], 0
    for _, size in counted:
        total += size
        running.append(total)
    frozen = [n for n, _ in counted[:bisect.bisect_right(running, int(total * ratio))]]
    return frozen + [OUTPUT] if tied and EMBEDDING in frozen else frozen


def _matched(rules: FreezeRules, names: List[str], tied: bool) -> Dict[str, Tuple[str, List[str]]]:
    """{flag value: (flag, the names it matches)} of every prefix and expression."""
    out = {}
    for flag, prefixes, pattern in (("--freeze_parameters", rules.freeze, rules.freeze_regex),
                                    ("--trainable_parameters", rules.trainable,
                                     rules.trainable_regex)):
        for prefix in prefixes:
            out[f"{flag} {prefix}"] = (flag, _prefix_matches(prefix, names, tied))
        if pattern is not None:
            out[f"{flag}_regex {pattern}"] = (flag, _regex_matches(pattern, names, tied))
    return out


def trainable_names(table: Table, trainable: Set[str], rules: FreezeRules, tied: bool,
                    strict: bool = True) -> Set[str]:
    """The names of `table` that train after the rules (starting from `trainable`); `strict`:
    UserError naming each prefix or expression that matches no parameter, or when nothing
    trains."""
    names = [n for n, _ in table]
    matched = _matched(rules, names, tied)
    unmatched = [value for value, (_, found) in matched.items() if not found]
    if unmatched and strict:
        raise UserError(f"{'; '.join(unmatched)}: matches no parameter of this model. Names are "
                        "Megatron's: embedding.word_embeddings, decoder.layers.<N>. (global layer "
                        "numbers), decoder.final_layernorm, output_layer, visual. (HF's "
                        "model.embed_tokens is embedding.word_embeddings, model.layers.<N> is "
                        "decoder.layers.<N>, lm_head is output_layer)")
    result = set(trainable) - set(_by_ratio(table, rules.ratio, tied))
    for flag, found in matched.values():
        result = result - set(found) if flag == "--freeze_parameters" else result | set(found)
    if not result and strict:
        raise UserError("the freeze flags leave no parameter to train: name some with "
                        "--trainable_parameters or freeze less")
    return result


# ---- the dry run: names and sizes from the HF config ------------------------------------------

def estimated_table(hf: dict) -> List[Tuple[str, int]]:
    """The text model's Megatron parameters as the memory estimate counts them (model/memory.py
    `parameter_counts`: each layer's attention and MLP, its norms, the embedding and head), under
    their Megatron names, in model order."""
    hf, counts = text_config(hf), parameter_counts(hf)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    proj = heads * (hf.get("head_dim") or hidden // heads) * hidden
    table = [(EMBEDDING, counts["embedding"])]
    for layer in range(hf["num_hidden_layers"]):
        prefix = f"decoder.layers.{layer}."
        table += [(prefix + "input_layernorm.weight", hidden),
                  (prefix + "self_attention.linear_proj.weight", proj),
                  (prefix + "self_attention.linear_qkv.weight", counts["attention"] - proj),
                  (prefix + "pre_mlp_layernorm.weight", hidden)]
        table += _mlp_entries(prefix + "mlp.", hf, counts)
    table.append(("decoder.final_layernorm.weight", hidden))
    if counts["head"]:
        table.append((OUTPUT, counts["head"]))
    return table


def _mlp_entries(prefix: str, hf: dict, counts: dict) -> List[Tuple[str, int]]:
    hidden, experts = hf["hidden_size"], counts["experts"]
    if not experts:
        return [(prefix + "linear_fc1.weight", 2 * counts["mlp"] // 3),
                (prefix + "linear_fc2.weight", counts["mlp"] // 3)]
    ffn = hf["moe_intermediate_size"]
    entries = [(prefix + "router.weight", experts * hidden)]
    for expert in range(experts):
        entries += [(f"{prefix}experts.local_experts.{expert}.linear_fc1.weight", 2 * hidden * ffn),
                    (f"{prefix}experts.local_experts.{expert}.linear_fc2.weight", hidden * ffn)]
    if counts["shared"]:
        entries.append((prefix + "shared_experts.weight", counts["shared"]))
    return entries


def frozen_on_first_stage(hf: dict, rules: FreezeRules, tp: int, pp: int, ep: int) -> int:
    """Parameters the rules freeze on a rank of the first pipeline stage (the one the memory
    estimate counts): the embedding and its layers (with PP 1 also the head), matrices split
    over TP and experts over EP, norms whole."""
    table = estimated_table(hf)
    tied = bool(text_config(hf).get("tie_word_embeddings"))
    trains = trainable_names(table, {n for n, _ in table}, rules, tied, strict=False)
    layers = text_config(hf)["num_hidden_layers"] // pp
    frozen = 0
    for name, size in table:
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        on_stage = int(layer.group(1)) < layers if layer else name == EMBEDDING or pp == 1
        if name in trains or not on_stage:
            continue
        split = 1 if name.endswith("layernorm.weight") else tp
        frozen += size // (split * (ep if ".local_experts." in name else 1))
    return frozen


def saved_on_first_stage(hf: dict, modules: Sequence[str], tp: int, pp: int) -> int:
    """Parameters of --modules_to_save's modules (Megatron module paths) on a rank of the first
    pipeline stage: the word embedding, and with PP 1 an output layer of its own; split over
    TP. With tied embeddings the two names are one matrix."""
    counts, tied = parameter_counts(hf), bool(text_config(hf).get("tie_word_embeddings"))
    names = {f"{m}.weight" for m in modules}
    embedding = EMBEDDING in names or (tied and OUTPUT in names)
    head = OUTPUT in names and not tied and pp == 1
    return (counts["embedding"] * embedding + counts["head"] * head) // tp


def embedding_trains(hf: dict, rules: FreezeRules) -> bool:
    """Whether the word embedding trains under the freeze rules (full training)."""
    table = estimated_table(hf)
    tied = bool(text_config(hf).get("tie_word_embeddings"))
    return EMBEDDING in trainable_names(table, {n for n, _ in table}, rules, tied, strict=False)
