#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, into .whl/ here, before its first call (this machine has the
# package registries; that one reaches nothing). bench/gpu_session.sh installs them there into /tmp/site.
#
#   bash bench/gpu_wheels.sh        # then: run(command="bash bench/gpu_session.sh doctor", carry=[".whl"])
#
# The lent image ('cuda', Python 3.12) has torch, transformers, accelerate, msgpack, psutil, numpy,
# pyarrow, xxhash and nvidia-ml-py (/work/.library/device/KINDS.md), not pyzmq, msgspec or datasets (nor dill
# and multiprocess, which datasets needs). Each is pinned to the version this venv runs, so the GPU
# runs the code the suite passed with. .whl/ is ignored by git, so the call must name it in carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(pyzmq msgspec datasets dill multiprocess)
python=${PYTHON:-.venv/bin/python}
pins=()
for package in "${PACKAGES[@]}"; do
    version=$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package") \
        || { echo "gpu_wheels: $package is not installed in $python (pip install -e '.[test]' first)" >&2; exit 2; }
    pins+=("$package==$version")
done
rm -rf .whl && mkdir .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --dest .whl \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    "${pins[@]}"
ls .whl
