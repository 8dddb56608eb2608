#!/usr/bin/env bash
# device_run.sh phases that outlast one device call (10 minutes), e.g. the whole GPU gate:
#
#   bash tests/gpu/background.sh start matrix_all   # first call: returns at once
#                                                   # (after the phases started earlier end)
#   bash tests/gpu/background.sh wait 560           # next calls: wait up to 560 s, show progress
#   bash tests/gpu/background.sh collect            # last call: the matrix table, logs and
#                                                   # results.jsonl into $OUT
#
# Every device call copies the working tree afresh and drops what is not in it (the
# swift_megatron/cli link device_run.sh makes, so cases started after the next call's copy
# failed at once), and kills what the call started unless it runs in a new process session.
# So the phases run from a copy of the checkout ($BG_DIR/tree) in their own session (setsid):
# no case is cut at a call's end, and the machine stays warm while the next call follows
# within its idle time (docs/gpu.md, "The GPU gate").
set -uo pipefail
BG=${BG_DIR:-/tmp/bg}
OUT=${OUT:-/tmp/gpu_out}

progress() {   # the finished cases of a matrix phase, one line each
    grep -h '"name": "matrix_case"' "$BG"/out/*.log 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["case"], "pass" if not r["failed"] else "FAIL", r["seconds"], "s", *r["failed"][:2])'
}

running() { [ -f "$BG/pid" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; }

case "${1:-}" in
    start)
        shift
        while running; do sleep 2; done   # e.g. the gate's preparation (docs/gpu.md)
        rm -rf "$BG" && mkdir -p "$BG/tree" "$BG/out"
        tar --exclude=./.vparts -cf - . | tar -xf - -C "$BG/tree"
        cd "$BG/tree" || exit 1
        OUT="$BG/out" setsid nohup bash tests/gpu/device_run.sh "$@" > "$BG/run.log" 2>&1 \
            < /dev/null &
        echo $! > "$BG/pid"
        echo "started in the background: $*" ;;
    wait)
        deadline=$(( $(date +%s) + ${2:-560} ))
        while running && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
        running && echo "still running" || echo "finished"
        progress ;;
    collect)
        progress
        [ -f /tmp/gpu_matrix/results.jsonl ] && python3 -c '
import json, sys
sys.path.insert(0, sys.argv[1])
import matrix
print(matrix.table([json.loads(line) for line in open("/tmp/gpu_matrix/results.jsonl")]))' \
            "$BG/tree/tests/gpu"
        mkdir -p "$OUT" && tar czf "$OUT/background_logs.tgz" -C "$BG" out run.log
        # every result of this machine, for the next lease's .matrix/ (matrix.py --resume)
        results=/tmp/gpu_matrix/results.jsonl
        if [ -f "$results" ]; then cp "$results" "$OUT/"; fi ;;
    *) echo "usage: background.sh start PHASE... | wait [SECONDS] | collect"; exit 2 ;;
esac
