"""The generated flag reference (docs/arguments.md) matches the argument dataclasses."""
import os
import runpy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arguments_doc_is_current():
    module = runpy.run_path(os.path.join(REPO, "scripts", "gen_arguments_doc.py"))
    with open(os.path.join(REPO, "docs", "arguments.md")) as f:
        assert f.read() == module["render"](), "docs/arguments.md is stale: run " \
                                               "python scripts/gen_arguments_doc.py"
