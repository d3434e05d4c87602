#!/usr/bin/env bash
# The wheels the GPU check (scripts/bench_gpu.sh) installs on a GPU machine that reaches no package registry:
# Cuboid's own (built here from the clone: nothing is built there) and what it needs beside that machine's own
# torch, lightning, transformers and peft (hydra-core, omegaconf, antlr4, wandb and what they need), for CPython
# 3.12 on x86-64 Linux. Run it where pip reaches PyPI, from the repo's root, then carry the folder with the repo.
#
#     bash scripts/gpu_wheels.sh [DIR]     # default DIR: .whl (ignored by git); refuses to exceed 40 MB
#
# Packages the GPU machine already has are not carried: a second version beside the machine's would shadow it
# for everything else there.
set -euo pipefail
case "${1:-}" in -h | --help)
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
esac
DIR=${1:-.whl}
LIMIT_MB=40
mkdir -p "$DIR"
TARGET=(--python-version 3.12 --implementation cp --only-binary=:all:
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# wandb with everything it needs, resolved for the target; hydra-core and omegaconf alone (their antlr4 pin exists
# only as a source archive, built into a wheel below: it is pure Python).
python -m pip download -q "${TARGET[@]}" -d "$DIR" "wandb==0.31.0"
python -m pip download -q "${TARGET[@]}" --no-deps -d "$DIR" "hydra-core==1.3.8" "omegaconf==2.3.1"
python -m pip wheel -q --no-deps -w "$DIR" "antlr4-python3-runtime==4.9.3"
rm -f "$DIR"/cuboid-*.whl
python -m pip wheel -q --no-deps -w "$DIR" . # Cuboid itself, pure Python
# Already on the GPU machine (its image): dropped, so that its own versions stay in charge.
PRESENT="anyio certifi charset_normalizer click distro h11 httpcore httpx idna packaging protobuf pyyaml requests
sniffio typing_extensions urllib3 xxhash"
for name in $PRESENT; do
    rm -f "$DIR/$name"-[0-9]*.whl
done
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
ls -1 "$DIR"
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MB in $DIR"
if ((total > LIMIT_MB * 1024 * 1024)); then
    echo "gpu_wheels: over ${LIMIT_MB} MB: a device call carries at most 64 MB with the repo" >&2
    exit 1
fi
