#!/usr/bin/env bash
# The GPU check: one H100/H200-class GPU, no network, at most 8 minutes with its own set-up. The repo is the working
# directory; the wheels scripts/gpu_wheels.sh fetched (hydra-core, omegaconf, antlr4, wandb and their needs) lie in
# WHEELS (default .whl). Cuboid and those wheels go into a folder of their own (SITE, on PYTHONPATH): nothing of the
# machine's Python is changed. Then each check runs with its own time limit, prints PASS/FAIL and appends one JSON
# line to OUT; a failed check does not stop the others.
#
#     bash scripts/bench_gpu.sh            # MODEL=1b SEQ=2048 BATCH=2, weights of 8b, checkpoints of 150m
#     bash scripts/bench_gpu.sh --tiny     # the same checks on CPU with the debug model (CI runs this)
#
# Checks (limit, seconds): install 40, env 20, sync_audit 45, throughput eager 40, compiled 70, compiled +
# selective AC 70, attention 25, weights local 45, weights rank0 50, checkpoint 40, offload 35: 480 in all.
set -u
case "${1:-}" in
-h | --help)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
--tiny) TINY=1 ;;
"") TINY=0 ;;
*)
    echo "bench_gpu: unknown argument $1 (use --tiny, or none)" >&2
    exit 2
    ;;
esac
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/cuboid-site}
SCALE=1 # the limits below are for the GPU; on a shared 2-core CI machine, whose speed swings 2x, three times them
if [ "$TINY" = 1 ]; then
    SCALE=3 MODEL=debug SEQ=64 BATCH=2 BIG=debug CKPT=debug ACC=cpu PREC=32-true ATTN_SEQ=64
    OUT=${OUT:-/tmp/cuboid-gpu-check-tiny.jsonl}
else
    MODEL=${MODEL:-1b} SEQ=${SEQ:-2048} BATCH=${BATCH:-2} BIG=${BIG:-8b} CKPT=${CKPT:-150m} ACC=gpu
    PREC=bf16-mixed ATTN_SEQ=${ATTN_SEQ:-8192}
    OUT=${OUT:-docs/bench/gpu.jsonl}
fi
mkdir -p "$(dirname "$OUT")"
: >"$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
declare -a SUMMARY=()
START=$(date +%s)
GPU=(--accelerator "$ACC" --precision "$PREC")

check() { # check NAME SECONDS COMMAND...: a program (timeout cannot run a shell function)
    local name=$1 limit=$(($2 * SCALE)) t0 code
    shift 2
    t0=$(date +%s)
    echo "=== $name (limit ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@"
    code=$?
    if [ $code = 0 ]; then
        SUMMARY+=("PASS $name ($(($(date +%s) - t0)) s)")
    else
        SUMMARY+=("FAIL $name (exit $code$([ $code = 124 ] && echo ": over its limit"), $(($(date +%s) - t0)) s)")
    fi
    echo "${SUMMARY[-1]}"
}

# Set-up: where Cuboid already imports with hydra and wandb (CI, a developer's environment), nothing; else the
# wheels and Cuboid itself (no dependencies, no build isolation: the machine's setuptools builds it) into SITE.
if ! $PY -c "import cuboid, hydra, wandb" 2>/dev/null; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    install_cmd="set -e; mkdir -p '$SITE'
        if ls '$WHEELS'/*.whl >/dev/null 2>&1; then
            $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' '$WHEELS'/*.whl
        else echo 'no wheels in $WHEELS: run scripts/gpu_wheels.sh where PyPI is reachable' >&2; fi
        $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target '$SITE' .
        $PY -c 'import cuboid; print(\"cuboid\", cuboid.__version__, \"from\", cuboid.__file__)'"
    check install 40 bash -c "$install_cmd"
fi

G="scripts/bench/gpu.py"
check env 20 $PY $G env "${GPU[@]}" --out "$OUT"
check "sync_audit $MODEL" 45 $PY $G sync_audit --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --steps 7 --warmup 3 "${GPU[@]}" --out "$OUT"
for variant in "" "--compile" "--compile --ac selective"; do
    limit=$([ -z "$variant" ] && echo 40 || echo 70)
    # shellcheck disable=SC2086  # the variant's words are separate options
    check "throughput $MODEL ${variant:-eager}" $limit $PY $G throughput --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --steps 12 --warmup 4 $variant "${GPU[@]}" --out "$OUT"
done
check "attention (cp 4 shapes)" 25 $PY $G attention --seq "$ATTN_SEQ" --cp 4 "${GPU[@]}" --out "$OUT"
check "weights $BIG local" 45 $PY $G weights --model "$BIG" --init local "${GPU[@]}" --out "$OUT"
check "weights $BIG rank0" 50 $PY $G weights --model "$BIG" --init rank0 "${GPU[@]}" --out "$OUT"
check "checkpoint $CKPT sync+async" 40 $PY scripts/bench.py --suite checkpoint --model "$CKPT" --devices 1 --accelerator "$ACC" --out /tmp/cuboid-gpu-checkpoint.json --append "$OUT"
check "offload $CKPT" 35 $PY $G offload --model "$CKPT" --seq "$SEQ" --batch "$BATCH" --steps 6 "${GPU[@]}" --out "$OUT"

echo
echo "=== summary ($(($(date +%s) - START)) s in all; figures in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
failed=$(printf '%s\n' "${SUMMARY[@]}" | grep -c '^FAIL')
exit $((failed > 0))
