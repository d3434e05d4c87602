#!/usr/bin/env bash
# The GPU check: one H100/H200-class GPU that reaches no package registry, in two commands of at most 300 s each
# (the limits below, kill margins included), so that a rerun fits in a 15-minute slot. The repo is the working
# directory; WHEELS (default .whl) holds the wheels scripts/gpu_wheels.sh made where PyPI is reachable: Cuboid's own
# and hydra-core, omegaconf, antlr4, wandb with their needs. They are installed with pip --no-index into a folder of
# their own (SITE, put first on PYTHONPATH): nothing of the machine's Python is changed and nothing is built there.
# Each check runs under its own limit, prints PASS/FAIL and appends one JSON line to OUT: OUT/gpu.jsonl when OUT is
# a folder (the device machine's $OUT), else the file OUT; a failed check does not stop the others.
#
#     bash scripts/bench_gpu.sh 1        # install, env, attention, sync audit, eager throughput
#     bash scripts/bench_gpu.sh 2        # install, compile, compile + selective AC, weights, checkpoint, offload
#     bash scripts/bench_gpu.sh --tiny   # both parts on CPU with the debug model, one after the other (CI)
#
# Part 1 (limit s): install 30, env 15, attention 45, sync_audit 45, throughput eager 50: 185 + 5 x 5 = 210.
# Part 2: install 30, compiled 60, compiled + selective AC 55, weights local 30, weights rank0 30, checkpoint 30,
# offload 25: 260 + 7 x 5 = 295.
set -u
TINY=0
PART=
for arg in "$@"; do
    case "$arg" in
    -h | --help)
        sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    --tiny) TINY=1 ;;
    1 | 2) PART=$arg ;;
    *)
        echo "bench_gpu: unknown argument $arg (use 1 or 2, and --tiny)" >&2
        exit 2
        ;;
    esac
done
if [ -z "$PART" ]; then # both parts, one after the other (on a GPU machine, run them as two commands)
    bash "$0" "$@" 1
    first=$?
    bash "$0" "$@" 2
    exit $((first || $?))
fi
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/cuboid-site}
KILL=5  # seconds between the TERM at a check's limit and the KILL
SCALE=1 # the limits below are for the GPU; on a shared 2-core CI machine, whose speed swings 2x, three times them
if [ "$TINY" = 1 ]; then
    SCALE=3 MODEL=debug SEQ=64 BATCH=2 BIG=debug SMALL=debug CKPT=debug ACC=cpu PREC=32-true ATTN_SEQ=256
    OUT=${OUT:-/tmp/cuboid-gpu-check-tiny.jsonl}
else
    MODEL=${MODEL:-1b} SEQ=${SEQ:-2048} BATCH=${BATCH:-2} BIG=${BIG:-8b} SMALL=${SMALL:-1b} CKPT=${CKPT:-150m}
    ACC=gpu PREC=bf16-mixed ATTN_SEQ=${ATTN_SEQ:-16384}
    OUT=${OUT:-docs/bench/gpu.jsonl}
fi
if [ -d "$OUT" ]; then # the device machine's $OUT is a folder: the lines go into a file there
    OUT="$OUT/gpu.jsonl"
else
    mkdir -p "$(dirname "$OUT")"
fi
[ "$PART" = 1 ] && : >"$OUT" # part 1 starts the file; part 2 adds to it
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
declare -a SUMMARY=()
START=$(date +%s)
GPU=(--accelerator "$ACC" --precision "$PREC")

check() { # check NAME SECONDS COMMAND...: a program (timeout cannot run a shell function)
    local name=$1 limit=$(($2 * SCALE)) t0 code
    shift 2
    t0=$(date +%s)
    echo "=== $name (limit ${limit} s): $*"
    timeout --kill-after=$KILL "$limit" "$@"
    code=$?
    if [ $code = 0 ]; then
        SUMMARY+=("PASS $name ($(($(date +%s) - t0)) s)")
    else
        SUMMARY+=("FAIL $name (exit $code$([ $code = 124 ] && echo ": over its limit"), $(($(date +%s) - t0)) s)")
    fi
    echo "${SUMMARY[-1]}"
}

# Set-up: Cuboid and what it needs beside the machine's torch and lightning, from WHEELS only (--no-index: no
# registry is asked, nothing is built), into SITE, first on PYTHONPATH. Without a Cuboid wheel there (a developer's
# environment, where Cuboid already imports), nothing is installed.
if ls "$WHEELS"/cuboid-*.whl >/dev/null 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    install_cmd="set -e; rm -rf '$SITE'; mkdir -p '$SITE'
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target '$SITE' '$WHEELS'/*.whl
        cd / && $PY -c 'import cuboid, hydra, wandb; print(\"cuboid\", cuboid.__version__, \"from\", cuboid.__file__)'"
    check install 30 bash -c "$install_cmd"
elif ! $PY -c "import cuboid, hydra, wandb" 2>/dev/null; then
    echo "bench_gpu: no Cuboid wheel in $WHEELS and Cuboid does not import: run scripts/gpu_wheels.sh first" >&2
    exit 2
fi

G="scripts/bench/gpu.py"
if [ "$PART" = 1 ]; then
    check env 15 $PY $G env "${GPU[@]}" --out "$OUT"
    check "attention (cp blocks, every kernel)" 45 $PY $G attention --seq "$ATTN_SEQ" --cp 4 "${GPU[@]}" --out "$OUT"
    check "sync_audit $MODEL" 45 $PY $G sync_audit --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --steps 7 --warmup 3 "${GPU[@]}" --out "$OUT"
    check "throughput $MODEL eager" 50 $PY $G throughput --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --steps 12 --warmup 4 "${GPU[@]}" --out "$OUT"
else
    check "throughput $MODEL compiled" 60 $PY $G throughput --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --steps 12 --warmup 4 --compile "${GPU[@]}" --out "$OUT"
    check "throughput $MODEL compiled + selective AC" 55 $PY $G throughput --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --steps 12 --warmup 4 --compile --ac selective "${GPU[@]}" --out "$OUT"
    check "weights $BIG local" 30 $PY $G weights --model "$BIG" --init local "${GPU[@]}" --out "$OUT"
    check "weights $SMALL rank0" 30 $PY $G weights --model "$SMALL" --init rank0 "${GPU[@]}" --out "$OUT"
    check "checkpoint $CKPT sync+async" 30 $PY scripts/bench.py --suite checkpoint --model "$CKPT" --devices 1 --accelerator "$ACC" --out /tmp/cuboid-gpu-checkpoint.json --append "$OUT"
    check "offload $CKPT" 25 $PY $G offload --model "$CKPT" --seq "$SEQ" --batch "$BATCH" --steps 6 "${GPU[@]}" --out "$OUT"
fi

echo
echo "=== part $PART: summary ($(($(date +%s) - START)) s in all; figures in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
failed=$(printf '%s\n' "${SUMMARY[@]}" | grep -c '^FAIL')
exit $((failed > 0))
