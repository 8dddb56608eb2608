#!/usr/bin/env bash
# On the GPU machine, from the checkout's root, in the call that carries .vparts/SHA256SUMS:
# install vLLM from the parts that earlier calls of the same warm machine copied to /tmp/vp
# (tests/gpu/vllm_parts.sh made them) into /tmp/vsite and /tmp/vsite_opt, and write
# /tmp/vllm_env.sh, which tests/gpu/device_run.sh sources.
set -uo pipefail
sums=$PWD/.vparts/SHA256SUMS
(cd /tmp/vp && sha256sum -c --quiet "$sums") || { echo "vLLM parts missing or corrupt"; exit 1; }
rm -rf /tmp/vw /tmp/vsite /tmp/vsite_opt && mkdir -p /tmp/vw
cat $(sed 's/.* //' "$sums" | sed 's|^|/tmp/vp/|') | tar -x -C /tmp/vw || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite /tmp/vw/core/*.whl \
    || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite_opt \
    /tmp/vw/opt/*.whl || exit 1
# --target folders are not site folders: their .pth files are ignored, so cutlass-dsl's path is
# added by hand
echo "export PYTHONPATH=/tmp/vsite_opt/nvidia_cutlass_dsl/dsl_packages:/tmp/vsite_opt:/tmp/vsite\${PYTHONPATH:+:\$PYTHONPATH}" \
    > /tmp/vllm_env.sh
. /tmp/vllm_env.sh && python3 -c 'import vllm; print("vllm", vllm.__version__, "installed")'
