"""The fast development subset (`python -m pytest tests/unit -m quick -n 2`, tests/conftest.py)
keeps tests of every package and module of swift_megatron: a quick test file imports each."""
import glob
import os
import re

from tests.conftest import NOT_QUICK

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _swift_megatron_parts() -> list:
    """The packages and modules directly under swift_megatron/."""
    root = os.path.join(REPO, "swift_megatron")
    names = []
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if os.path.isfile(os.path.join(path, "__init__.py")):
            names.append(entry)
        elif entry.endswith(".py") and entry != "__init__.py":
            names.append(entry[:-3])
    return names


def test_not_quick_names_existing_tests():
    """Each entry names a test file, and a `file::name` entry a test or fixture of that file."""
    for entry in NOT_QUICK:
        path, _, name = entry.partition("::")
        assert os.path.isfile(os.path.join(REPO, path)), entry
        if name:
            with open(os.path.join(REPO, path)) as f:
                assert re.search(rf"^def {name}\(", f.read(), re.MULTILINE), entry


def test_quick_subset_covers_every_package():
    quick = [path for path in sorted(glob.glob(os.path.join(REPO, "tests", "unit", "test_*.py")))
             if os.path.relpath(path, REPO) not in NOT_QUICK]
    texts = []
    for path in quick:
        with open(path) as f:
            texts.append(f.read())
    parts = _swift_megatron_parts()
    assert {"arguments", "bridge", "checkpoint", "data", "lora", "model", "rewards", "rlhf",
            "rollout", "report"} <= set(parts)
    missing = [name for name in parts
               if not any(re.search(rf"\bswift_megatron\.{name}\b|"
                                    rf"\bfrom swift_megatron import [^\n]*\b{name}\b", text)
                          for text in texts)]
    assert not missing, f"no quick tests/unit file imports swift_megatron.{missing}: add one, " \
                        f"or take its file out of tests/conftest.py NOT_QUICK"
