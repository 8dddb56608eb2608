"""Dataset loading: turn one `--dataset` spec into a list of row dicts.

A spec is one of
- a local file: `.jsonl` (one object per line), `.json` (a list of objects, or `{"data": [...]}`),
  `.csv` (every value read as a string; empty cells are "") or `.parquet`;
- a local directory: written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict whose
  "train" split, or only split, is used), or holding data files of the forms above (searched
  recursively, sorted by path; when some paths name a `train` split, only those are read);
- a hub id (`owner/name`): downloaded from ModelScope by default (a dataset snapshot, then read
  as a directory), from Hugging Face with `use_hf=True` (`datasets.load_dataset`, "train" split).

`spec#N` (or `spec:N`, N all digits) uses N rows, as ms-swift's dataset syntax does: a random
sample drawn with the caller's numpy RandomState (ms-swift: one `RandomState(data_seed)` shared by
the specs of one flag, in order), or the first N rows when shuffling is off; when N exceeds the
rows, every row is repeated N // rows times and the remainder sampled the same way. The suffix is
recognised only when `spec` without it is an existing path or a hub id, so a file really named
`a.jsonl:3` still loads whole. Rows are plain dicts: a GRPO prompt set of ~100k rows loads in a
second or two. Every failure a user can fix is a UserError naming the spec.
"""
import importlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger

logger = get_logger(__name__)

Row = Dict[str, Any]

FILE_FORMATS = (".jsonl", ".json", ".csv", ".parquet")
# Extensions that make a spec look like a file path rather than a hub id.
_FILE_LIKE = FILE_FORMATS + (".tsv", ".txt", ".arrow", ".xlsx", ".xls", ".gz", ".zip")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_LIMIT = re.compile(r"(.+?)[:#](\d+)")
_BAD_LIMIT = re.compile(r"(.+)[:#]([^:#/]*)")   # a file with a suffix that is not a row count
_TRAIN_PATH = re.compile(r"(^|[^a-z])train([^a-z]|$)", re.IGNORECASE)


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed `--dataset` value: where the rows come from and how many to keep."""

    spec: str                   # as the user wrote it (used in messages)
    source: str                 # path (user-expanded) or hub id
    kind: str                   # "file", "dir" or "hub"
    limit: Optional[int] = None  # use this many rows (sampled, see the module docstring)


def parse_spec(spec: str) -> DatasetSpec:
    """Classify `spec` as a local file, a local directory or a hub id, and split off `:N`/`#N`.

    Raises UserError for an empty spec, N < 1, or a path-looking spec that does not exist."""
    if not spec or not spec.strip():
        raise UserError("--dataset got an empty value; give a file, a directory or a hub id")
    source, limit = spec, None
    if not os.path.exists(os.path.expanduser(spec)):
        match = _LIMIT.fullmatch(spec)
        if match and (os.path.exists(os.path.expanduser(match.group(1))) or _is_hub_id(match.group(1))):
            source, limit = match.group(1), int(match.group(2))
            if limit < 1:
                raise UserError(f"dataset {spec}: the row count after '#' must be at least 1")
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return DatasetSpec(spec, path, "dir", limit)
    if os.path.exists(path):
        return DatasetSpec(spec, path, "file", limit)
    if _is_hub_id(source):
        return DatasetSpec(spec, source, "hub", limit)
    suffix = _BAD_LIMIT.fullmatch(spec)
    if suffix and os.path.exists(os.path.expanduser(suffix.group(1))):
        raise UserError(f"dataset {spec}: {suffix.group(1)} exists; the {suffix.group(2)!r} after "
                        f"'#' must be a whole number of rows, at least 1 (e.g. "
                        f"{suffix.group(1)}#1000)")
    raise UserError(f"dataset {spec}: no such file or directory (and it is not a hub id of the "
                    f"form owner/name); check the path")


def _is_hub_id(text: str) -> bool:
    """`owner/name` or `name` that does not look like a file path."""
    if text.startswith((".", "/", "~")) or "\\" in text or text.lower().endswith(_FILE_LIKE):
        return False
    return _HUB_ID.fullmatch(text) is not None


def load_rows(spec: str, *, use_hf: bool = False, num_proc: int = 1,
              random_state: Optional[np.random.RandomState] = None,
              shuffle: bool = True) -> List[Row]:
    """Load the rows of one `--dataset` spec (see the module docstring) as a list of dicts.

    use_hf: hub ids come from Hugging Face instead of ModelScope. num_proc: passed to
    `datasets.load_dataset` for Hugging Face ids (local files load in one process).
    random_state / shuffle: how `#N` samples (default: a RandomState seeded 42, ms-swift's
    data_seed default)."""
    parsed = parse_spec(spec)
    if parsed.kind == "file":
        rows = read_file(parsed.source, spec=spec)
    elif parsed.kind == "dir":
        rows = read_directory(parsed.source, spec=spec)
    elif use_hf:
        rows = _load_hf_hub(parsed.source, spec=spec, num_proc=num_proc)
    else:
        rows = _load_modelscope_hub(parsed.source, spec=spec)
    if parsed.limit is None:
        return rows
    if not rows:
        raise UserError(f"dataset {spec} has no rows to sample {parsed.limit} from")
    if parsed.limit > len(rows):
        logger.warning(f"dataset {spec}: {parsed.limit} rows asked for, it has {len(rows)}: rows "
                       f"are repeated (as ms-swift does)")
    state = random_state if random_state is not None else np.random.RandomState(42)
    return [rows[i] for i in sample_indices(len(rows), parsed.limit, shuffle, state)]


def load_many(specs: Sequence[str], *, use_hf: bool = False, num_proc: int = 1,
              seed: int = 42, shuffle: bool = True) -> List[Tuple[str, List[Row]]]:
    """Load several specs in order, their `#N` samples drawn from one RandomState(seed); returns
    [(spec, rows)] so callers can name the source of a bad row. Concatenate the row lists (in
    this order) for the combined dataset."""
    state = np.random.RandomState(seed)
    return [(spec, load_rows(spec, use_hf=use_hf, num_proc=num_proc, random_state=state,
                             shuffle=shuffle)) for spec in specs]


def sample_indices(num_rows: int, count: int, shuffle: bool,
                   random_state: np.random.RandomState) -> List[int]:
    """ms-swift's sampling of `count` rows out of `num_rows`: every row count // num_rows times
    in order, then count % num_rows more, a random choice without repeats (the first ones
    without shuffle)."""
    repeats, remain = divmod(count, num_rows)
    indices = list(range(num_rows)) * repeats
    if remain:
        extra = random_state.permutation(num_rows)[:remain] if shuffle else range(remain)
        indices += [int(i) for i in extra]
    return indices


# ---------------------------------------------------------------------------------------------
# Local files and directories


def read_file(path: str, *, spec: Optional[str] = None) -> List[Row]:
    """Rows of one .jsonl/.json/.csv/.parquet file; UserError for other extensions or bad content."""
    spec = spec or path
    ext = os.path.splitext(path)[1].lower()
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv,
               ".parquet": _read_parquet}
    if ext not in readers:
        raise UserError(f"dataset {spec}: unsupported file type {ext or '(no extension)'!r}; use "
                        f"{', '.join(FILE_FORMATS)}, a directory saved by datasets, or a hub id")
    return readers[ext](path, spec)


def _read_jsonl(path: str, spec: str) -> List[Row]:
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(f"dataset {spec} line {line_no}: not UTF-8 text (byte "
                                f"{raw[error.start]:#04x} at column {error.start + 1}); save the "
                                "file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"dataset {spec} line {line_no}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"dataset {spec} line {line_no}: each line must be a JSON object, "
                                f"got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_json(path: str, spec: str) -> List[Row]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as error:
        raise UserError(f"dataset {spec}: not valid JSON (line {error.lineno}: {error.msg}); "
                        f"for one object per line name the file .jsonl") from None
    except UnicodeDecodeError as error:
        raise UserError(f"dataset {spec}: not UTF-8 text (byte {error.object[error.start]:#04x} "
                        f"at offset {error.start}); save the file as UTF-8") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise UserError(f"dataset {spec}: a .json dataset must be a list of objects or "
                        f'{{"data": [objects]}}')
    return data


def _read_csv(path: str, spec: str) -> List[Row]:
    import pandas as pd

    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise UserError(f"dataset {spec}: cannot read it as CSV ({error})") from None
    return frame.to_dict(orient="records")


def _read_parquet(path: str, spec: str) -> List[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except pa.ArrowException as error:
        raise UserError(f"dataset {spec}: cannot read it as Parquet ({error})") from None


def read_directory(path: str, *, spec: Optional[str] = None) -> List[Row]:
    """Rows of a `save_to_disk` directory, or of the data files under `path` (see module doc)."""
    spec = spec or path
    if _is_saved_dataset(path):
        import datasets

        return _dataset_rows(datasets.load_from_disk(path), spec)
    files = data_files(path)
    if not files:
        raise UserError(f"dataset {spec}: the directory holds no {'/'.join(FILE_FORMATS)} files and "
                        f"was not written by datasets' save_to_disk")
    rows: List[Row] = []
    for file in files:
        rows.extend(read_file(file, spec=f"{spec} ({os.path.relpath(file, path)})"))
    return rows


def _is_saved_dataset(path: str) -> bool:
    names = set(os.listdir(path))
    return "dataset_dict.json" in names or {"dataset_info.json", "state.json"} <= names


def data_files(path: str) -> List[str]:
    """Data files under directory `path` (hidden entries skipped), sorted; only those whose
    relative path names a `train` split when there are any."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(root, name) for name in files
                     if not name.startswith(".") and name.lower().endswith(FILE_FORMATS))
    found.sort()
    train = [f for f in found if _TRAIN_PATH.search(os.path.relpath(f, path))]
    return train or found


def _dataset_rows(dataset: Any, spec: str) -> List[Row]:
    """Rows of a `datasets` Dataset, or of the "train" (or only) split of a DatasetDict."""
    if isinstance(dataset, dict):  # DatasetDict is a dict of splits
        splits = list(dataset.keys())
        if "train" in splits:
            dataset = dataset["train"]
        elif len(splits) == 1:
            dataset = dataset[splits[0]]
        else:
            raise UserError(f"dataset {spec}: it has the splits {', '.join(splits)} and no 'train' "
                            f"split; save the split you want on its own")
    return dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)


# ---------------------------------------------------------------------------------------------
# Hubs (need the network)


def _download_failed(spec: str, hub: str, error: Exception) -> UserError:
    other = "Hugging Face (--use_hf true)" if hub == "ModelScope" else "ModelScope (--use_hf false)"
    return UserError(f"dataset {spec}: could not download it from {hub} "
                     f"({type(error).__name__}: {error}). Check the id and your network, or pass a "
                     f"local path instead (a jsonl/json/csv/parquet file or a directory); the id may "
                     f"also live on {other}.")


def _load_modelscope_hub(dataset_id: str, *, spec: str) -> List[Row]:
    """Download a ModelScope dataset snapshot and read it as a directory."""
    hub = importlib.import_module("modelscope.hub.snapshot_download")
    logger.info(f"downloading dataset {dataset_id} from ModelScope")
    try:
        local_dir = hub.dataset_snapshot_download(dataset_id)
    except Exception as error:  # any network/hub failure: the user can fix it
        raise _download_failed(spec, "ModelScope", error) from error
    return read_directory(local_dir, spec=spec)


def _load_hf_hub(dataset_id: str, *, spec: str, num_proc: int = 1) -> List[Row]:
    """`datasets.load_dataset(dataset_id)`; the "train" (or only) split."""
    import datasets

    logger.info(f"loading dataset {dataset_id} from Hugging Face")
    try:
        dataset = datasets.load_dataset(dataset_id, num_proc=num_proc if num_proc > 1 else None)
    except Exception as error:  # any network/hub failure: the user can fix it
        raise _download_failed(spec, "Hugging Face", error) from error
    return _dataset_rows(dataset, spec)
