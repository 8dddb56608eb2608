"""Rows -> prompts: chat messages, the tokenizer's chat template, tokenisation, left truncation.

A row gives its prompt as
- `messages`: a list of {"role", "content"} (roles system/user/assistant/tool, string content);
  a trailing assistant message is dropped (the model generates that turn), and a `system`
  column, when present, is prepended as the system message;
- or `query` / `prompt`: a string, with an optional `system` string column.
A row without a system message gets `--system` (data/system.py), when given. With
--agent_template hermes a row's `tools` column joins its system message (data/agent.py).
A row may hold images (ms-swift's multimodal format, for a vision-language model):
`images`, a list of paths, URLs, bytes or `{"bytes", "path"}` dicts, one per `<image>` tag of
its messages (tags are prepended to the first user message when the row has none). The model's
image encoder (data/images.py `ImageEncoder`) loads them, and each tag of the templated prompt
becomes the processor's number of image tokens; the prompt keeps the image values and their
`image_grid_thw` (pixels are computed again at rollout time, not held for the whole dataset).
Other names (`question`, `problem`, ...) are not guessed: map them with `--columns`, which is
applied first. Every remaining column (e.g. `solution`) is kept per prompt, unchanged, for the
reward functions; prompts of one dataset (or of all `--dataset`s together) share one set of
column names, None where a row lacks a column.

The prompt text is `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`
(plus `enable_thinking` when --enable_thinking is given), tokenized with
`add_special_tokens=False` (the template already holds any BOS). Prompts longer than
`max_prompt_length` (= max_length - max_completion_length) keep their LAST tokens
(--truncation_strategy left) or are dropped (delete); one warning counts them. A prompt with
images is never cut (that would cut its image tokens): with `left` it is an error.
Bad rows raise UserError naming the dataset and the 1-based row number.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from swift_megatron.data import agent
from swift_megatron.data.sources import Row, load_rows
from swift_megatron.data.system import system_prompt
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger

logger = get_logger(__name__)

Message = Dict[str, str]
ROLES = ("system", "user", "assistant", "tool")
PROMPT_KEYS = ("messages", "query", "prompt")
# Names the trainer passes to reward functions itself; a dataset column must not shadow them.
RESERVED_COLUMNS = ("completions", "prompts", "completion_ids", "truncated")
_CHUNK = 1024  # rows templated and tokenized per batch


@dataclass
class Prompt:
    """One prompt of the dataset, ready for the rollout engine.

    prompt_id: stable index in the (concatenated) dataset; text: the templated prompt (decoded
    from the kept tokens when truncated); input_ids: its tokens, what the engine should consume;
    messages: the chat turns it was built from; columns: the row's other columns (for rewards)."""

    prompt_id: int
    text: str
    input_ids: List[int]
    messages: List[Message]
    columns: Dict[str, Any] = field(default_factory=dict)
    truncated: bool = False
    images: Optional[List[Any]] = None             # the row's image values (paths, bytes, ...)
    image_grid_thw: Optional[List[List[int]]] = None   # per image, as the processor gives it


class RowError(UserError):
    """A bad row; `where` is filled in by the caller that knows the dataset and row number."""


# ---------------------------------------------------------------------------------------------
# Budget


def max_prompt_length(max_length: Optional[int], max_completion_length: int,
                      max_position_embeddings: Optional[int] = None) -> int:
    """Tokens left for the prompt: max_length (default: the model's max_position_embeddings)
    minus max_completion_length. UserError naming both flags when that is below 1."""
    if max_length is None:
        if max_position_embeddings is None:
            raise ValueError("max_length is None: pass the model's max_position_embeddings")
        length_text = f"--max_length (default: the model's max_position_embeddings, {max_position_embeddings})"
        max_length = max_position_embeddings
    else:
        length_text = f"--max_length ({max_length})"
    budget = max_length - max_completion_length
    if budget < 1:
        raise UserError(f"{length_text} - --max_completion_length ({max_completion_length}) = {budget} "
                        f"leaves no room for the prompt; raise --max_length or lower "
                        f"--max_completion_length")
    return budget


# ---------------------------------------------------------------------------------------------
# Rows -> messages


def rename_columns(row: Row, columns: Optional[Dict[str, str]]) -> Row:
    """Apply the --columns rename map to one row (names the row lacks are skipped). Two columns
    ending up with one name is an error unless one of them is None (a hole left by merging)."""
    if not columns:
        return row
    renamed: Row = {}
    for key, value in row.items():
        new = columns.get(key, key)
        if renamed.get(new) is not None and value is not None:
            raise RowError(f"--columns {columns} leaves two columns named {new!r}; drop one of "
                            f"them from the data or rename to another name")
        if new not in renamed or value is not None:
            renamed[new] = value
    return renamed


def row_messages(row: Row, default_system: Optional[str] = None
                 ) -> Tuple[List[Message], Dict[str, Any]]:
    """The chat messages a row asks the model to answer, and its other columns. A row without a
    system message gets `default_system` (--system) when given."""
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowError(f"'system' must be a string, got {type(system).__name__}")
    if row.get("messages") is not None:
        messages, used = _check_messages(row["messages"]), "messages"
        if system:
            if messages[0]["role"] == "system":
                raise RowError("it has both a 'system' column and a system message; keep one")
            messages.insert(0, {"role": "system", "content": system})
    else:
        used = next((key for key in ("query", "prompt") if row.get(key) is not None), None)
        if used is None:
            raise RowError(f"no prompt: expected a 'messages' list or a 'query'/'prompt' string, "
                            f"found the columns {', '.join(map(repr, row)) or '(none)'}; rename yours "
                            f"with --columns, e.g. '{{\"question\": \"query\"}}'")
        if not isinstance(row[used], str):
            raise RowError(f"{used!r} must be a string, got {type(row[used]).__name__}")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": row[used]}]
    if messages[-1]["role"] == "user" and not messages[-1]["content"].strip() \
            and not row.get("images"):
        raise RowError(f"its prompt is empty: the last user message has no text (from "
                       f"{used!r}); drop the row or fill it")
    if default_system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": default_system})
    others = {k: v for k, v in row.items() if k not in (used, "system")}
    reserved = [k for k in RESERVED_COLUMNS if k in others]
    if reserved:
        raise RowError(f"the column(s) {', '.join(map(repr, reserved))} clash with the names the "
                        f"trainer passes to reward functions; rename them with --columns")
    return messages, others


def row_images(row: Row) -> List[Any]:
    """The row's `images` column as a list (a single value is one image; none: []). RowError
    for a row with videos (not supported yet)."""
    if row.get("videos"):
        raise RowError("it has videos, which are not supported yet (docs/multimodal.md)")
    images = row.get("images")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _check_messages(messages: Any) -> List[Message]:
    """Validated {role, content} copies, without a trailing assistant message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RowError("'messages' must be a non-empty list of {role, content}")
    checked = []
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RowError(f"'messages' must be a list of {{role, content}}; message {number} is "
                            f"{message!r:.80}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise RowError(f"message {number} has role {role!r}; roles must be one of "
                            f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise RowError(f"message {number} ({role}) content must be a string, got "
                            f"{type(content).__name__}")
        checked.append({"role": role, "content": content})
    if checked[-1]["role"] == "assistant":
        checked.pop()
    if not checked or checked[-1]["role"] not in ("user", "tool"):
        raise RowError("'messages' must end with a user (or tool) message, optionally followed "
                        "by one assistant answer, which is dropped")
    return checked


# ---------------------------------------------------------------------------------------------
# Messages -> text and tokens


def check_chat_template(tokenizer: Any) -> None:
    """UserError when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise UserError(f"the tokenizer of {name} has no chat template, so prompts cannot be "
                        f"built; use a chat/instruct model, or add a 'chat_template' to its "
                        f"tokenizer_config.json")


def render_chunk(tokenizer: Any, conversations: Sequence[List[Message]], spec: str,
                 first_row: int, template_kwargs: Optional[Dict[str, Any]] = None
                 ) -> Tuple[List[str], List[List[int]]]:
    """Template and tokenize consecutive rows (row numbers from `first_row`, 1-based);
    `template_kwargs` go to the chat template (e.g. enable_thinking)."""
    import jinja2

    texts = []
    for offset, messages in enumerate(conversations):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **(template_kwargs or {}))
        except jinja2.TemplateError as error:
            raise UserError(f"dataset {spec} row {first_row + offset}: the chat template rejected "
                            f"the messages ({error})") from None
        texts.append(text)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return texts, [list(ids) for ids in encoded]


_worker_tokenizer = None


def _init_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _render_in_worker(job: Tuple[Sequence[List[Message]], str, int]):
    return render_chunk(_worker_tokenizer, *job)


def render_all(tokenizer: Any, conversations: List[List[Message]], spec: str,
               num_proc: int = 1, template_kwargs: Optional[Dict[str, Any]] = None
               ) -> Tuple[List[str], List[List[int]]]:
    """Template and tokenize every conversation, in `num_proc` spawned processes when > 1."""
    jobs = [(conversations[i:i + _CHUNK], spec, i + 1, template_kwargs)
            for i in range(0, len(conversations), _CHUNK)]
    if num_proc > 1 and len(jobs) > 1:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # safe with threads and CUDA in the parent
        with context.Pool(min(num_proc, len(jobs)), _init_worker, (tokenizer,)) as pool:
            results = pool.map(_render_in_worker, jobs)
    else:
        results = [render_chunk(tokenizer, *job) for job in jobs]
    texts = [text for chunk_texts, _ in results for text in chunk_texts]
    ids = [row_ids for _, chunk_ids in results for row_ids in chunk_ids]
    return texts, ids


# ---------------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True)
class PromptSettings:
    """How rows become prompts (from the data flags)."""

    max_prompt_length: int                        # max_length - max_completion_length
    columns: Optional[Dict[str, str]] = None      # --columns rename map
    num_proc: int = 1                             # --dataset_num_proc
    system: Optional[str] = None                  # --system, as text
    enable_thinking: Optional[bool] = None        # --enable_thinking
    truncation_strategy: str = "left"             # --truncation_strategy: left | delete
    agent_template: Optional[str] = None          # --agent_template (data/agent.py)

    def template_kwargs(self) -> Dict[str, Any]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


def _with_tools(messages: List[Message], columns: Dict[str, Any],
                agent_template: Optional[str]) -> List[Message]:
    """With --agent_template hermes, a row's `tools` column in its system prompt."""
    if agent_template != "hermes" or not columns.get("tools"):
        return messages
    try:
        return agent.with_tools(messages, agent.parse_tools(columns["tools"]))
    except ValueError as error:
        raise RowError(str(error)) from None


def build_prompts(rows: Sequence[Row], tokenizer: Any, settings: PromptSettings, *,
                  spec: str = "dataset", first_id: int = 0, images: Any = None) -> List[Prompt]:
    """One Prompt per row (prompt_id = first_id + row index), see the module docstring; with
    truncation_strategy delete, over-long prompts are left out (ids of the others unchanged).
    `images`: the model's ImageEncoder (data/images.py), None for a text-only model.

    Raises UserError for a bad row (naming `spec` and the row number), an empty `rows`, or a
    tokenizer without chat template. Logs one warning counting the truncated/dropped prompts."""
    if settings.max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {settings.max_prompt_length}")
    if not rows:
        raise UserError(f"dataset {spec} has no rows")
    check_chat_template(tokenizer)
    conversations, others, values = [], [], []
    for number, row in enumerate(rows, 1):
        try:
            if not isinstance(row, dict):
                raise RowError(f"a row must be an object, got {type(row).__name__}")
            row = rename_columns(row, settings.columns)
            messages, extra = row_messages(row, settings.system)
            messages = _with_tools(messages, extra, settings.agent_template)
            values.append(row_images(row))
            if values[-1]:
                if images is None:
                    raise RowError("it has images, but the model takes text only; use a "
                                   "vision-language model (docs/multimodal.md)")
                messages = images.tag(messages, len(values[-1]))
        except RowError as error:
            raise UserError(f"dataset {spec} row {number}: {error}") from None
        conversations.append(messages)
        others.append(extra)
    texts, ids = render_all(tokenizer, conversations, spec, settings.num_proc,
                            settings.template_kwargs())
    prompts = [Prompt(first_id + i, text, row_ids, messages, extra)
               for i, (text, row_ids, messages, extra) in enumerate(zip(texts, ids, conversations, others))]
    for number, (prompt, row_values) in enumerate(zip(prompts, values), 1):
        if row_values:
            _add_images(prompt, row_values, tokenizer, images, f"dataset {spec} row {number}")
    prompts = _fit(prompts, tokenizer, settings, spec)
    align_columns(prompts)
    return prompts


def _add_images(prompt: Prompt, values: List[Any], tokenizer: Any, images: Any,
                where: str) -> None:
    """Load and process the prompt's images: its tokens get the expanded image tags."""
    try:
        grid = images.encode(values)["image_grid_thw"]
        prompt.text = images.expand(prompt.text, grid)
    except RowError as error:
        raise UserError(f"{where}: {error}") from None
    prompt.input_ids = list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
    prompt.images, prompt.image_grid_thw = list(values), grid.tolist()


def align_columns(prompts: Sequence[Prompt]) -> None:
    """Give every prompt the same column names (first-seen order), None where a row lacks one,
    as a `datasets` table would: reward functions get one aligned list per column."""
    names: Dict[str, None] = {}
    for prompt in prompts:
        names.update(dict.fromkeys(prompt.columns))
    for prompt in prompts:
        if len(prompt.columns) != len(names) or list(prompt.columns) != list(names):
            prompt.columns = {name: prompt.columns.get(name) for name in names}


def _fit(prompts: List[Prompt], tokenizer: Any, settings: PromptSettings,
         spec: str) -> List[Prompt]:
    """Prompts over max_prompt_length: keep their last tokens (left) or drop them (delete);
    one warning with the count. UserError when delete would leave nothing."""
    budget = settings.max_prompt_length
    long = [p for p in prompts if len(p.input_ids) > budget]
    if not long:
        return prompts
    with_images = [p for p in long if p.images]
    if with_images and settings.truncation_strategy == "left":
        first = with_images[0]
        raise UserError(f"dataset {spec} row {first.prompt_id - prompts[0].prompt_id + 1}: its "
                        f"prompt with images has {len(first.input_ids)} tokens, over max_length - "
                        f"max_completion_length = {budget}, and image tokens cannot be cut; "
                        f"raise --max_length, lower --max_pixels, or use --truncation_strategy "
                        f"delete")
    action = ("were truncated from the left (their last tokens are kept)"
              if settings.truncation_strategy == "left" else "were dropped")
    logger.warning(f"dataset {spec}: {len(long)} of {len(prompts)} prompts were longer than "
                   f"max_length - max_completion_length = {budget} tokens and {action} "
                   f"(--truncation_strategy {settings.truncation_strategy}); raise --max_length "
                   f"or lower --max_completion_length to keep them whole")
    if settings.truncation_strategy == "delete":
        kept = [p for p in prompts if len(p.input_ids) <= budget]
        if not kept:
            raise UserError(f"dataset {spec}: every prompt is longer than {budget} tokens, and "
                            f"--truncation_strategy delete drops them all")
        return kept
    for prompt in long:
        prompt.input_ids = prompt.input_ids[-budget:]
        prompt.text = tokenizer.decode(prompt.input_ids, skip_special_tokens=False)
        prompt.truncated = True
    return prompts


def load_prompts(specs: Sequence[str], tokenizer: Any, settings: PromptSettings, *,
                 use_hf: bool = False, seed: int = 42, shuffle: bool = True,
                 images: Any = None, flag: str = "--dataset") -> List[Prompt]:
    """Load every spec in order and build its prompts; prompt ids run on across datasets.
    `#N` samples come from one RandomState(seed) (--data_seed), without shuffle the first N.
    `images`: the model's ImageEncoder, None for a text-only model. UserError when --columns
    renames a column that no row of these datasets (`flag`, for the message) has."""
    prompts: List[Prompt] = []
    state = np.random.RandomState(seed)
    found: Dict[str, None] = {}
    for spec in specs:
        rows = load_rows(spec, use_hf=use_hf, num_proc=settings.num_proc, random_state=state,
                         shuffle=shuffle)
        prompts.extend(build_prompts(rows, tokenizer, settings, spec=spec, first_id=len(prompts),
                                     images=images))
        for row in rows:
            found.update(dict.fromkeys(row))
    check_renamed_columns(settings.columns, found, flag, specs)
    align_columns(prompts)
    return prompts


def check_renamed_columns(columns: Optional[Dict[str, str]], found: Sequence[str], flag: str,
                          specs: Sequence[str]) -> None:
    """UserError when --columns renames a column that none of the rows (`found`: their column
    names) of the datasets `specs` given to `flag` has."""
    missing = [name for name in columns or {} if name not in found]
    if missing:
        raise UserError(f"--columns renames {', '.join(map(repr, missing))}, which no row of "
                        f"{flag} {' '.join(specs)} has; its columns: "
                        f"{', '.join(map(repr, found)) or '(none)'}")


def split_validation(prompts: List[Prompt], ratio: float,
                     seed: int) -> Tuple[List[Prompt], List[Prompt]]:
    """Hold out ceil(ratio * n) prompts (a seeded random choice) for validation.

    Both parts keep the dataset order and their prompt ids. ratio 0 -> (prompts, [])."""
    if ratio <= 0:
        return list(prompts), []
    num_val = math.ceil(ratio * len(prompts))
    if num_val >= len(prompts):
        raise UserError(f"--split_dataset_ratio {ratio} would hold out all {len(prompts)} prompts; "
                        f"lower it or pass --val_dataset")
    chosen = set(np.random.RandomState(seed % 2**32).permutation(len(prompts))[:num_val].tolist())
    train = [p for i, p in enumerate(prompts) if i not in chosen]
    val = [p for i, p in enumerate(prompts) if i in chosen]
    return train, val


def prepare_prompts(args: Any, tokenizer: Any, *, max_position_embeddings: Optional[int] = None,
                    images: Any = None) -> Tuple[List[Prompt], List[Prompt]]:
    """(train, val) prompts from the data flags: --dataset, --val_dataset or
    --split_dataset_ratio, --max_length, --max_completion_length, --columns, --dataset_num_proc,
    --system, --enable_thinking, --truncation_strategy, --agent_template, --data_seed,
    --dataset_shuffle, --use_hf, --seed. `max_position_embeddings` is the default of --max_length; `images`: the
    model's ImageEncoder (data/images.py), None for a text-only model."""
    if not args.dataset:
        raise UserError("--dataset is required: a jsonl/json/csv/parquet file, a directory or a hub id")
    settings = PromptSettings(
        max_prompt_length(args.max_length, args.max_completion_length, max_position_embeddings),
        columns=args.columns, num_proc=args.dataset_num_proc, system=system_prompt(args.system),
        enable_thinking=args.enable_thinking, truncation_strategy=args.truncation_strategy,
        agent_template=args.agent_template)
    common = dict(use_hf=args.use_hf, seed=args.data_seed, shuffle=args.dataset_shuffle,
                  images=images)
    train = load_prompts(args.dataset, tokenizer, settings, **common)
    if args.val_dataset:
        return train, load_prompts(args.val_dataset, tokenizer, settings, **common,
                                   flag="--val_dataset")
    return split_validation(train, args.split_dataset_ratio, args.seed)
