#!/usr/bin/env bash
# Here (a machine with PyPI): gather what the H200 machine lacks into DEST, in parts that each fit one
# device call (64 MiB with the project): the small wheels, and mlx-cuda-13 (~90 MB) unpacked, repacked
# as .tar.xz, split, with its sha256. Then: bash benchmarks/device/h200.sh on the device (see there).
#   bash benchmarks/device/pack.sh DEST
set -euo pipefail
dest=${1:?usage: pack.sh DEST}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dest/wheels" "$dest/parts"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" \
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 'pyzmq>=27' 'structlog>=25'
mv "$tmp"/mlx_cuda_13-*.whl "$tmp/cuda.whl"
cp "$tmp"/*.whl "$dest/wheels/" && rm "$dest/wheels/cuda.whl"
mkdir "$tmp/cuda" && (cd "$tmp/cuda" && python3 -m zipfile -e ../cuda.whl .)
tar -C "$tmp/cuda" -cf - . | xz -6 -T2 > "$tmp/mlx-cuda-13.tar.xz"
(cd "$tmp" && sha256sum mlx-cuda-13.tar.xz > "$dest/parts/mlx-cuda-13.tar.xz.sha256")
split -b 40M -d "$tmp/mlx-cuda-13.tar.xz" "$dest/parts/mlx-cuda-13.tar.xz.part"
# the project as committed (the device call sends another checkout) and the script that runs there
git -C "$here" archive --format=tar HEAD > "$dest/src.tar"
cp "$here/benchmarks/device/h200.sh" "$dest/"
ls -la "$dest" "$dest/wheels" "$dest/parts"
