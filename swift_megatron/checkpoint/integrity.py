"""Up-front checks of a checkpoint of ours before any rank loads it: a damaged file (truncated by a
full disk or an interrupted copy, or garbage) is a UserError naming the file and what is wrong,
instead of a traceback from deep inside megatron's or torch's loaders on every rank.

Checked without reading the weights: the JSON files parse; every distributed-checkpoint directory
(model/, optimizer/, ref_model/) has readable metadata and each data file is at least as long as
the metadata says; the `torch.save` files (common.pt, rng/*.pt) are intact zip archives (their
CRCs are read, which is cheap for these small files).
"""
import json
import os
import zipfile

from swift_megatron.errors import UserError

JSON_FILES = ("swift_megatron.json", "trainer_state.json")
DCP_DIRS = ("model", "optimizer", "ref_model")
HINT = "the checkpoint is damaged: resume from another iter_* directory (edit " \
       "latest_checkpointed_iteration.txt) or start without --load"


class Damaged(Exception):
    """A damaged file: what is wrong with it (check_checkpoint_files adds the hint)."""


def check_checkpoint_files(directory: str, hint: str = HINT) -> None:
    """UserError for the first damaged file of the checkpoint at `directory` (see module doc),
    ending with `hint` (what to do instead)."""
    try:
        for name in JSON_FILES:
            _check_json(os.path.join(directory, name))
        for name in DCP_DIRS:
            if os.path.isdir(os.path.join(directory, name)):
                _check_dcp(os.path.join(directory, name))
        rng = os.path.join(directory, "rng")
        if os.path.isdir(rng):
            for name in sorted(os.listdir(rng)):
                _check_zip(os.path.join(rng, name))
    except Damaged as damage:
        raise UserError(f"{damage}; {hint}") from None


def _check_json(path: str) -> None:
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Damaged(f"{path}: not valid JSON ({exc})") from None


def _check_zip(path: str) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise Damaged(f"{path}: not a readable torch.save file ({exc})") from None
    if bad is not None:
        raise Damaged(f"{path}: entry {bad} fails its CRC check")


def _check_dcp(path: str) -> None:
    """A torch distributed checkpoint directory: metadata readable, data files long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # a truncated pickle raises EOFError, UnpicklingError, ...
        raise Damaged(f"{os.path.join(path, '.metadata')}: unreadable ({type(exc).__name__}: "
                      f"{exc})") from None
    needed = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        data = os.path.join(path, name)
        size = os.path.getsize(data) if os.path.isfile(data) else None
        if size is None:
            raise Damaged(f"{data}: missing (the checkpoint's metadata lists it)")
        if size < end:
            raise Damaged(f"{data}: truncated ({size} bytes, the metadata needs {end})")
    common = os.path.join(path, "common.pt")
    if os.path.isfile(common):
        _check_zip(common)
    _check_json(os.path.join(path, "metadata.json"))
