"""Every GRPO example script passes `--dry_run true`: its flags parse and its batch arithmetic
satisfies every rule for the world size it launches (nothing is loaded or downloaded)."""
import glob
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "scripts", "grpo", "*.sh")))


def test_there_are_examples():
    names = {os.path.basename(s) for s in SCRIPTS}
    assert {"cpu_demo.sh", "one_gpu.sh", "eight_gpus_tp2.sh", "lora_two_gpus_tp2.sh",
            "dense_colocate.sh", "dense_server.sh", "moe_colocate_full.sh",
            "moe_colocate_lora.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_example_dry_run(script, tmp_path):
    env = dict(os.environ, WORK=str(tmp_path))
    proc = subprocess.run(["bash", script, "--dry_run", "true"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "generation_batch_size" in proc.stdout  # the plan was printed
