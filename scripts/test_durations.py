"""Write tests/durations.json, the seconds each test file took, from a pytest --junitxml report.

The test session (tests/conftest.py) hands files to the pytest-xdist workers longest first, so
that the run does not end with one worker busy on a long file while the other idles. Refresh the
table after adding or slowing a test file:

    python -m pytest tests -q -n 2 --dist loadfile --no-loadscope-reorder --junitxml=/tmp/j.xml
    python scripts/test_durations.py /tmp/j.xml
"""
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def file_seconds(junit_xml: str) -> dict:
    """{test file path: seconds of its tests, setup and teardown included}."""
    seconds = collections.Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname").split(".")
        while module and not module[-1].startswith("test_"):   # a test class's name
            module.pop()
        seconds["/".join(module) + ".py"] += float(case.get("time") or 0)
    return {path: round(s) for path, s in sorted(seconds.items())}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(file_seconds(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {TABLE}")
