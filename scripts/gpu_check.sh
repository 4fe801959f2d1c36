#!/usr/bin/env bash
# GPU check: run pynccl's GPU-only tests and a short perf sweep from this checkout, then print
# a compact summary. Meant for a machine with an NVIDIA GPU and no network: nothing is
# installed, the checkout is used in place (PYTHONPATH=.), and the machine is expected to have
# numpy, pytest, hypothesis, nvidia-nccl-cu13 and, for the interop tests, cupy, torch and
# cuda-python. Every step has a time limit, and the whole run a budget (GPU_CHECK_BUDGET
# seconds, default 540: under a 10-minute lease with room to spare); a step that fails or
# times out is reported and the next one still runs; one that no longer fits is reported as
# skipped for time.
#
# Steps: info; the hazard probes of issue 20 (scripts/gpu_probes.py: one JSON line each,
# streams held busy to widen race windows, compute-sanitizer's memcheck when installed;
# torch/CuPy probes say "skipped" with the reason where those are absent); the gpu-marked
# tests; perf sweeps. With one GPU visible everything runs as one rank, and the summary says
# "1 rank only" rather than OK for paths that need two GPUs (several ranks in one process,
# ranks on two devices, an abortive shrink): those were not checked.
#
#   scripts/gpu_check.sh            # PYTHON=python3 by default; logs in a temporary directory
#   GPU_CHECK_LOG_DIR=out PYTHON=.venv/bin/python scripts/gpu_check.sh
#   GPU_CHECK_STEPS="info probes" GPU_CHECK_PROBES="dangling-stream" scripts/gpu_check.sh
#                                   # a rerun of some steps (and some probes) only
#
# Exit status: 0 when every step passed (with one GPU: "RESULT: OK, 1 rank only"); 1 when a
# step failed; 2 when no GPU is visible (the GPU tests then only show that they skip cleanly,
# and the probes and perf steps are left out).
#
# PYNCCL_GPU_REHEARSAL=1 runs every step on the loopback libraries instead (2 emulated devices,
# PYNCCL_GPU_REHEARSAL_DEVICES to change it; small sizes): a dress rehearsal of this script and
# of tests/gpu/test_gpu.py where no GPU is lent (tests/gpu/test_gpu_rehearsal.py does it in every test
# run). Nothing is checked on a GPU then, and a probe's FAIL is reported without failing the
# run (the rehearsal checks the script; the strict loopback's own tests check the hazards).
set -u
set -o pipefail

cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
unset RANK WORLD_SIZE LOCAL_RANK
PY="${PYTHON:-python3}"
REHEARSAL="${PYNCCL_GPU_REHEARSAL:-0}"
if [ "$REHEARSAL" = 1 ]; then
    # The loopback libraries stand in for the GPU and NCCL.
    export PYNCCL_LOOPBACK_DEVICES="${PYNCCL_GPU_REHEARSAL_DEVICES:-2}"
    loopback_env=$("$PY" -c 'import shlex; from pynccl.testing import loopback
for k, v in loopback.env().items(): print(f"export {k}={shlex.quote(v)}")') || exit 1
    eval "$loopback_env"
    MAX_ALL_REDUCE=1M MAX_GRAPH=256K MAX_EACH=64K
else
    # The real libraries, whatever the calling shell had pointed pynccl at.
    unset PYNCCL_NCCL_LIBRARY PYNCCL_CUDART_LIBRARY PYNCCL_GPU_REHEARSAL
    MAX_ALL_REDUCE=256M MAX_GRAPH=64M MAX_EACH=16M
fi
LOG_DIR="${GPU_CHECK_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/pynccl-gpu-check.XXXXXX")}"
mkdir -p "$LOG_DIR"
START=$SECONDS
BUDGET="${GPU_CHECK_BUDGET:-540}"

names=()
results=()
notes=()
failed=0
out_of_time=0
one_rank=0

# Seconds left of the budget.
left() {
    echo $((BUDGET - (SECONDS - START)))
}

# run NAME LIMIT_SECONDS COMMAND...: run with a time limit (cut to what is left of the
# budget), keep the log, record the outcome.
run() {
    local name=$1 limit=$2
    shift 2
    local log="$LOG_DIR/$name.log" t0=$SECONDS rc remaining
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
        return 0  # not asked for: neither run nor listed
    fi
    remaining=$(($(left) - 5))
    if [ "$remaining" -lt 15 ]; then
        echo "=== $name: SKIPPED, out of time (budget ${BUDGET}s)"
        names+=("$name")
        results+=("SKIPPED (out of time)")
        notes+=("not run: the budget of ${BUDGET}s was spent")
        out_of_time=$((out_of_time + 1))
        return 0
    fi
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    echo "=== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    rc=$?
    local took=$((SECONDS - t0))
    names+=("$name")
    if [ "$rc" -eq 0 ]; then
        results+=("ok      ${took}s")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        results+=("TIMEOUT ${took}s (limit ${limit}s)")
        failed=1
    else
        results+=("FAILED  ${took}s (exit $rc)")
        failed=1
    fi
    local note
    note=$(summarize "$name" "$log")
    if [ "$one_rank" = 1 ]; then
        case "$name" in
            pytest* | perf* | probes) note="${note:+$note; }1 rank only" ;;
        esac
    fi
    notes+=("$note")
    return "$rc"
}

# One line of what a step's log says: pytest's totals, perf's verdicts.
summarize() {
    local name=$1 log=$2
    case "$name" in
        pytest*)
            grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|deselected)' "$log" | tail -n 1 \
                | tr -d '=' | sed 's/^ *//'
            ;;
        perf*)
            local wrong bw
            wrong=$(grep -E '^# Out of bounds values' "$log" | sed 's/^# Out of bounds values *: *//')
            bw=$(grep -E '^# Avg bus bandwidth' "$log" | sed 's/^# Avg bus bandwidth *: *//')
            if [ -n "$wrong$bw" ]; then
                echo "out of bounds: ${wrong:-?}${bw:+; avg busbw: $bw GB/s}"
            else
                grep -E 'error|Error' "$log" | tail -n 1 | cut -c1-100
            fi
            ;;
        probes)
            grep -E '^# probes:' "$log" | tail -n 1 | sed 's/^# probes: *//'
            ;;
        info)
            { grep -E '^libnccl ' "$log" | awk '{print "libnccl " $2 ";"}'
              grep -E '^GPUs ' "$log" | sed 's/^GPUs *//'; } | tr '\n' ' ' | cut -c1-100
            ;;
        *)
            tail -n 1 "$log" | cut -c1-100
            ;;
    esac
}

echo "# pynccl GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), logs in $LOG_DIR"
[ "$REHEARSAL" = 1 ] && echo "# REHEARSAL: on the loopback libraries, not on a GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 30 nvidia-smi -L || true
fi

run info 60 "$PY" -m pynccl info

gpus=$(timeout 60 "$PY" -c 'from pynccl import cuda; print(cuda.device_count())' 2>/dev/null | tail -n 1)
case "$gpus" in
    '' | *[!0-9]*) gpus=0 ;;
esac
echo "# visible GPUs: $gpus"
if [ "$gpus" -eq 1 ]; then
    one_rank=1
    echo "# 1 rank only: one GPU is visible, so the multi-rank paths (several ranks in one" \
        "process, ranks on two devices, an abortive shrink) are skipped, not checked"
fi

# The hazards of issue 20, one JSON line per probe (scripts/gpu_probes.py).
if [ "$gpus" -gt 0 ]; then
    probe_limit=300
    remaining=$(($(left) - 5))
    [ "$probe_limit" -gt "$remaining" ] && probe_limit=$remaining
    probe_args=(--budget $((probe_limit > 40 ? probe_limit - 20 : 20)))
    [ "$REHEARSAL" = 1 ] && probe_args+=(--rehearsal)
    read -r -a probe_names <<<"${GPU_CHECK_PROBES:-}"
    run probes "$probe_limit" "$PY" scripts/gpu_probes.py "${probe_args[@]}" \
        ${probe_names[@]+"${probe_names[@]}"}
else
    echo "# no GPU visible: the hazard probes are left out"
fi

# Every gpu-marked test of the suite (tests/gpu/test_gpu.py and the others'). pytest exits 0 when
# all of them skip, so the summary line is checked too: on a GPU machine something must pass.
run pytest-gpu 240 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests
pytest_rc=$?
last=$((${#names[@]} - 1))
if [ "$last" -ge 0 ] && [ "${names[$last]}" = pytest-gpu ] && [[ "${results[$last]}" == ok* ]] \
    && [ "$gpus" -gt 0 ] && [ "$pytest_rc" -eq 0 ] \
    && ! grep -qE '[0-9]+ passed' "$LOG_DIR/pytest-gpu.log"; then
    results[${#results[@]} - 1]="FAILED  (no GPU test passed: all skipped?)"
    failed=1
fi

if [ "$gpus" -gt 0 ]; then
    # nccl-tests-style sweeps on every visible GPU (one rank each: -g says how many, as the
    # loopback would otherwise pick 2), results checked (-c 1).
    run perf-all_reduce 90 "$PY" -m pynccl perf all_reduce -g "$gpus" -b 8 -e "$MAX_ALL_REDUCE" \
        -f 4 -n 20 -w 2 -c 1 -T 80 --json "$LOG_DIR/perf-all_reduce.json"
    run perf-all_reduce-graph 60 "$PY" -m pynccl perf all_reduce -g "$gpus" -b 1K -e "$MAX_GRAPH" \
        -f 8 -n 10 -G 5 -c 1 -T 50
    MAX_EACH="$MAX_EACH" NGPUS="$gpus" run perf-every-collective 120 "$PY" - <<'PY'
import os, subprocess, sys
colls = ["all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
         "all_to_all", "sendrecv"]
bad = []
for c in colls:
    cmd = [sys.executable, "-m", "pynccl", "perf", c, "-g", os.environ["NGPUS"], "-b", "1K",
           "-e", os.environ["MAX_EACH"], "-f", "16", "-n", "5", "-w", "1", "-c", "1", "-T", "25"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=40)
    rows = [l for l in p.stdout.splitlines() if l and not l.startswith("#")]
    print(f"{c:>15}: exit {p.returncode}, {len(rows)} rows, last: {rows[-1] if rows else '-'}")
    if p.returncode != 0:
        bad.append(c)
        print(p.stdout[-2000:], p.stderr[-2000:], sep="\n")
verdict = "FAILED " + ",".join(bad) if bad else "0 OK"
print(f"# Out of bounds values : {verdict}")
sys.exit(1 if bad else 0)
PY
else
    echo "# no GPU visible: perf steps left out (python -m pynccl perf would use the loopback)"
fi

echo
echo "==================== pynccl GPU check summary ($((SECONDS - START))s, $gpus GPU(s)) ===================="
for i in "${!names[@]}"; do
    printf '%-24s %-34s %s\n' "${names[$i]}" "${results[$i]}" "${notes[$i]}"
done
echo "logs: $LOG_DIR"
caveats=""
if [ "$one_rank" = 1 ]; then
    caveats=", 1 rank only (one GPU visible: the multi-rank paths were skipped, not checked)"
fi
if [ "$out_of_time" -gt 0 ]; then
    caveats="$caveats, $out_of_time step(s) not run (out of time)"
fi
if [ "$failed" -ne 0 ]; then
    echo "RESULT: FAILED$caveats"
    exit 1
fi
if [ "$REHEARSAL" = 1 ]; then
    echo "RESULT: REHEARSAL OK$caveats (every step passed on the loopback; nothing was checked on a GPU)"
    exit 0
fi
if [ "$gpus" -eq 0 ]; then
    echo "RESULT: NO GPU (nothing was checked on a GPU)"
    exit 2
fi
echo "RESULT: OK$caveats"
exit 0
