"""Run several `megatron export` command lines in one process, so that a test pays the CLI's
start-up (torch, megatron-core, transformers imports) once:

    python -m tests.export_jobs jobs.json

jobs.json: [[name, [flag, value, ...]], ...] or [name, [flags], {VAR: value}] for a job that
needs environment variables (e.g. NPROC_PER_NODE: the CLI then relaunches that job under
torchrun), run in order. After each job the output has a line `=== <name> exit=<code>`; a
UserError's message (exit code 2) is printed before it, as the CLI does.
"""
import json
import os
import sys
from unittest import mock

from swift_megatron.cli.main import run
from swift_megatron.errors import UserError


def main(path: str) -> None:
    with open(path) as f:
        jobs = json.load(f)
    for name, argv, *env in jobs:
        with mock.patch.dict(os.environ, env[0] if env else {}):
            try:
                code = run(["export", *map(str, argv)])
            except UserError as exc:
                print(f"error: {exc}", flush=True)
                code = exc.exit_code
        print(f"=== {name} exit={code}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
