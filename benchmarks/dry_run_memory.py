"""The dry run's memory estimate of a `megatron rlhf` command and the training memory a run of it
measured, side by side: shared by trl_compare.py, auto_grid.py and the GPU gate
(tests/gpu/matrix.py), whose code fingerprint covers this file and not the benchmarks around it.
Feeds docs/gpu.md, "Memory and the dry run's estimate" and the GPU gate's estimate column.
"""
import json
import re
import subprocess


def memory_estimate(cmd: list, env: dict) -> dict:
    """The dry run's per-GPU estimate ({part: GiB}) for the same command; {} when the dry run
    fails (reported as a `dry_run_failed` JSON line, and the measurement still runs)."""
    proc = subprocess.run([*cmd, "--dry_run", "true"], capture_output=True, text=True, env=env)
    return parse_estimate(proc.returncode, proc.stdout + proc.stderr)


def parse_estimate(returncode: int, text: str) -> dict:
    """{part: GiB} of a dry run's output, {} (and a `dry_run_failed` JSON line) if it failed."""
    match = re.search(r"memory per GPU \(estimate, GiB\): (.*)", text)
    if returncode != 0 or not match:
        print(json.dumps(dict(name="dry_run_failed", returncode=returncode,
                              tail=text[-2000:])), flush=True)
        return {}
    return {name: float(value) for name, value in
            (part.rsplit(" ", 1) for part in match.group(1).split(", "))}


def memory_check(rows: list, estimate: dict) -> dict:
    """The measured training memory (the logprob and train phases' peak less the sleeping
    engine's share of torch's counter; CUDA runs log both) next to the dry run's estimate."""
    def peak(key):
        return max((r.get(key) or 0.0 for r in rows), default=0.0)

    result = {f"estimate/{key}_gib": estimate[key]
              for key in ("train", "logprobs", "generate", "peak") if key in estimate}
    phases = {phase: peak(f"memory/{phase}_peak_gib") for phase in ("rollout", "logprobs", "train",
                                                                    "sync", "sync_check")}
    if any(phases.values()):
        asleep = peak("memory/engine_asleep_gib")
        training = max(phases["logprobs"], phases["train"]) - asleep
        result.update({f"measured/{phase}_peak_gib": v for phase, v in phases.items() if v},
                      engine_asleep_gib=asleep, training_gib=training,
                      estimate_vs_training=max(estimate["train"], estimate.get("logprobs", 0))
                      / training if training > 0 and "train" in estimate else None)
    return result
