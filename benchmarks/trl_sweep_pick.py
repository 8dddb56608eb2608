"""TRL's fastest setting from a sweep: of trl_compare.py's `--tool trl --trl_settings fastest`
runs in a log (device_run.sh's trl_fastest_sweep, one run per candidate set of GRPOConfig
fields), the one with the fewest seconds per rollout batch. Prints the fields it adds to TRL's
`fastest` setting as the JSON object `--trl_fastest` takes (device_run.sh's later phases read it
as TRL_FASTEST; {} where the setting alone was fastest), and on stderr each candidate that ran,
with its seconds and peak memory.
Feeds docs/gpu.md, "GRPO against TRL" (device_run.sh's trl_fastest_sweep).

    python benchmarks/trl_sweep_pick.py $OUT/trl_fastest_sweep.log > $OUT/trl_fastest.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_compare import TRL_SETTINGS  # noqa: E402


def summaries(lines) -> list:
    """The `summary` lines of TRL's `fastest` setting, in the order they ran."""
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("name") == "summary" \
                and record.get("tool") == "trl_fastest":
            found.append(record)
    return found


def pick(runs: list) -> dict:
    """The GRPOConfig fields the fastest run adds to TRL's `fastest` setting; {} when none ran."""
    if not runs:
        return {}
    base = TRL_SETTINGS["fastest"]
    config = min(runs, key=lambda run: run["wall_s"])["config"]
    return {key: value for key, value in config.items() if key not in base or base[key] != value}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = summaries(f)
    for run in runs:
        print(f"trl_fastest_sweep: {run['wall_s']:.3f} s per rollout batch, "
              f"{run.get('peak_gib')} GiB: {json.dumps(run['config'])}", file=sys.stderr)
    print(json.dumps(pick(runs)))
