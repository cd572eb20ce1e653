#!/usr/bin/env bash
# Downloads FlashAttention-4 (flash_attn.cute, CuTe DSL; it has Hopper forward and backward kernels,
# compiled when first called) as pinned wheels for CPython 3.12 on x86-64 Linux, and, with
# --install SITE, unpacks them into SITE, so that the benchmarks can time it beside fa4cpp
# (bench/sweep.py's FA4 column). Nothing of FlashAttention-4 is part of this repository.
#   usage: scripts/fetch_fa4.sh DEST               download the wheels into DEST (needs PyPI)
#          scripts/fetch_fa4.sh --install DEST SITE  unpack DEST's wheels into SITE (offline)
#   then:  PYTHONPATH=SITE/nvidia_cutlass_dsl/dsl_packages:SITE (wheels' .pth files are not read
#          from PYTHONPATH, so the DSL's package folder is named too). einops, cuda-bindings and
#          protobuf must already be installed (torch's CUDA environments have them).
set -euo pipefail
wheels=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)
if [ "${1:-}" = --install ]; then
  dest=$2 site=$3
  mkdir -p "$site"
  for w in "$dest"/*.whl; do python3 -m zipfile -e "$w" "$site"; done
  echo "PYTHONPATH=$site/nvidia_cutlass_dsl/dsl_packages:$site"
  exit 0
fi
dest=$1
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "${wheels[@]}"
