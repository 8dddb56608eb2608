"""Run several `megatron export` command lines in one process, so that a test pays the CLI's
start-up (torch, megatron-core, transformers imports) once:

    python -m tests.export_jobs jobs.json

jobs.json: [[name, [flag, value, ...]], ...], run in order. After each job the output has a line
`=== <name> exit=<code>`; a UserError's message (exit code 2) is printed before it, as the CLI
does.
"""
import json
import sys

from swift_megatron.cli.main import run
from swift_megatron.errors import UserError


def main(path: str) -> None:
    with open(path) as f:
        jobs = json.load(f)
    for name, argv in jobs:
        try:
            code = run(["export", *map(str, argv)])
        except UserError as exc:
            print(f"error: {exc}", flush=True)
            code = exc.exit_code
        print(f"=== {name} exit={code}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
