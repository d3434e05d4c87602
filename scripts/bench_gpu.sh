#!/usr/bin/env bash
# One fresh GPU machine, the repo as cwd, only package registries reachable: install, then each check below with
# its own time limit. Prints PASS/FAIL per check and goes on after a failure; the figures go to
# docs/bench/gpu.jsonl (one JSON line per check). Under 8 minutes on one H100/H200-class GPU.
#
#     bash scripts/bench_gpu.sh            # MODEL=1b SEQ=2048 BATCH=4 by default
#     MODEL=150m bash scripts/bench_gpu.sh
set -u
MODEL=${MODEL:-1b}
SEQ=${SEQ:-2048}
BATCH=${BATCH:-4}
OUT=${OUT:-docs/bench/gpu.jsonl}
PY=${PYTHON:-python}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
declare -a SUMMARY=()
START=$(date +%s)

check() {  # check NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*"
    if timeout --kill-after=10 "$limit" "$@"; then
        SUMMARY+=("PASS $name ($(( $(date +%s) - t0 )) s)")
    else
        SUMMARY+=("FAIL $name (exit $?, $(( $(date +%s) - t0 )) s)")
    fi
    echo "${SUMMARY[-1]}"
}

install() {
    if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        $PY -m pip install -q "torch>=2.13" || return 1
    fi
    $PY -m pip install -q -e ".[dev]" || return 1
    $PY -c "import torch, cuboid; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
}

check install 240 install
check "throughput $MODEL eager" 120 $PY scripts/bench/gpu.py throughput --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --out "$OUT"
check "throughput $MODEL compile" 180 $PY scripts/bench/gpu.py throughput --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --compile --out "$OUT"
check "throughput $MODEL compile+selective AC" 180 $PY scripts/bench/gpu.py throughput --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --compile --ac selective --out "$OUT"
check "resume 150m sync save" 90 $PY scripts/bench/gpu.py resume --model 150m --seq 1024 --out "$OUT"
check "resume 150m async save" 90 $PY scripts/bench/gpu.py resume --model 150m --seq 1024 --async-save --out "$OUT"
check "cpu_offload 150m meta init + clipping" 90 $PY scripts/bench/gpu.py offload --model 150m --seq 1024 --steps 8 --out "$OUT"

echo
echo "=== summary ($(( $(date +%s) - START )) s in all; figures in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
cat "$OUT"
