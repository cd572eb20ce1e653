#!/usr/bin/env bash
# Installs the project's pinned third-party files into third_party/ (git-ignored).
#   CUTLASS/CuTe C++ headers: from the PyPI wheel nvidia-cutlass (pinned, sha256 checked).
# GoogleTest (the tests), CLI11 and nlohmann/json (fa4-bench's command line and --json record),
# OpenBLAS and Highway (the CPU backend's kernels) come from the system (Debian:
# libgtest-dev, libcli11-dev, nlohmann-json3-dev, libopenblas-pthread-dev, libhwy-dev); this
# script installs them with apt-get when they are missing and it runs as root.
# FA4_PYTHON_DEPS=1 (opt in): also the Python package's test environment, a venv in .venv/
# (git-ignored) with the pinned torch, pytest, scikit-build-core, nvidia-ml-py and transformers (the
# decode-loop example's model); scripts/test.sh
# runs tests/python with it when it exists. torch comes from PyPI with its CUDA libraries: about
# 5 GB and two minutes on a fresh machine.
set -euo pipefail

CUTLASS_VERSION=4.2.0.0
CUTLASS_WHEEL=nvidia_cutlass-${CUTLASS_VERSION}-py3-none-any.whl
CUTLASS_SHA256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
# nvidia-ml-py: NVML for bench/power_log.py (the 580 driver branch's release, as on the H200s).
# transformers: the Llama-style model of examples/decode_loop.py and its fp32 reference.
PYTHON_TEST_DEPS=(torch==2.11.0 pytest==8.4.2 scikit-build-core==1.1.2 nvidia-ml-py==13.580.82
                  transformers==5.25.0)

root=$(cd "$(dirname "$0")/.." && pwd)
third=$root/third_party
dest=$third/cutlass-$CUTLASS_VERSION

if [ ! -f "$dest/.complete" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --no-cache-dir "nvidia-cutlass==$CUTLASS_VERSION" -d "$tmp"
  echo "$CUTLASS_SHA256  $tmp/$CUTLASS_WHEEL" | sha256sum --check --quiet
  rm -rf "$dest"
  mkdir -p "$dest"
  python3 - "$tmp/$CUTLASS_WHEEL" "$dest" <<'PY'
import sys, zipfile, os
wheel, dest = sys.argv[1], sys.argv[2]
keep = {"cutlass_library/source/include/": "include/",
        "cutlass_library/source/tools/util/include/": "tools/util/include/"}
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        for src, dst in keep.items():
            if name.startswith(src) and not name.endswith("/"):
                out = os.path.join(dest, dst, name[len(src):])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(name) as f, open(out, "wb") as g:
                    g.write(f.read())
PY
  touch "$dest/.complete"
fi
ln -sfn "cutlass-$CUTLASS_VERSION" "$third/cutlass"

need=()
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need+=(libcli11-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
# The CPU backend's kernel libraries (cmake/fa4_cpu_deps.cmake).
[ -f "/usr/lib/$(gcc -print-multiarch)/openblas-pthread/libopenblas.a" ] ||
  need+=(libopenblas-pthread-dev)
[ -f /usr/include/hwy/highway.h ] || need+=(libhwy-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    echo "install_deps: missing system packages: ${need[*]} (apt-get install them)" >&2
    exit 1
  fi
fi
echo "install_deps: CUTLASS $CUTLASS_VERSION headers in third_party/cutlass"

if [ "${FA4_PYTHON_DEPS:-0}" = 1 ]; then
  venv=$root/.venv
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # No pip cache: the downloaded wheels would stay on disk beside the installed venv.
  "$venv/bin/python" -m pip install --quiet --no-cache-dir "${PYTHON_TEST_DEPS[@]}"
  echo "install_deps: ${PYTHON_TEST_DEPS[*]} in .venv"
fi
