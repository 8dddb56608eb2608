#!/usr/bin/env bash
# vLLM for a bare GPU machine, in parts a device call can carry (64 MiB a call, the working tree
# included): run here, where PyPI is reachable, from the checkout's root.
#
#   bash tests/gpu/vllm_parts.sh        # -> .vparts/p00..pNN (git-ignored) and .whl/
#
# Downloads the wheels of tests/gpu/vllm_wheels.txt (its [core] and [opt] groups, for the GPU
# machine's Python 3.12) into .vwheels/, packs them into one tar cut into .vparts/p00 (54 MiB,
# which travels beside .whl/ in the call that starts the machine) and 60 MiB parts after it,
# with their checksums in .vparts/SHA256SUMS; and megatron-core and flash-linear-attention,
# the gate's other wheels, into .whl/. On the device, each call copies its part to /tmp/vp,
# then tests/gpu/vllm_install.sh installs them all (docs/gpu.md, "The GPU gate").
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in /.vparts/ /.vwheels/ /.whl/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64
           manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64
           linux_x86_64)
download() {   # download DIR REQUIREMENT...
    local dir=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]/#/--platform=}" -d "$dir" "$@"
}
group() { sed -n "/^\[$1\]/,/^\[/p" tests/gpu/vllm_wheels.txt | grep -E '^[A-Za-z0-9]'; }

rm -rf .vwheels .vparts && mkdir -p .vwheels/core .vwheels/opt .vparts .whl
download .vwheels/core $(group core)
download .vwheels/opt $(group opt)
download .whl megatron-core==0.16.1 flash-linear-attention==0.6.0 fla-core==0.6.0
tar -cf .vparts/all.tar -C .vwheels core opt
head -c $((54 << 20)) .vparts/all.tar > .vparts/p00
tail -c +$(((54 << 20) + 1)) .vparts/all.tar | split -b 60M -d -a 2 --numeric-suffixes=1 - .vparts/p
rm .vparts/all.tar
(cd .vparts && sha256sum p[0-9][0-9] > SHA256SUMS)
ls -la .vparts .whl
