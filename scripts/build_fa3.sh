#!/usr/bin/env bash
# Builds FlashAttention-3 (Dao-AILab/flash-attention, hopper/) from a source archive, so that the
# benchmarks can time it beside fa4cpp in the same process (bench/sweep.py, bench/decode.py,
# bench/host_overhead.py import its `flash_attn_interface` module). Nothing of FlashAttention-3 is
# part of this repository: the archive is fetched by whoever runs the comparison.
#   usage: scripts/build_fa3.sh ARCHIVE DEST
#   ARCHIVE: a .tar.xz holding fa/hopper, fa/README.md (setup.py reads it) and
#            fa/csrc/cutlass/include (CUTLASS at the flash-attention submodule's commit), e.g.
#              git -C flash-attention archive HEAD hopper README.md | tar -x -C fa
#              git -C cutlass archive <submodule commit> include | tar -x -C fa/csrc/cutlass
#   DEST:    where it is unpacked; afterwards PYTHONPATH=DEST/fa/hopper imports it.
# FA3_ENABLE (default "paged append split packgqa varlen backward hdim128") names the features to
# build; every other FLASH_ATTENTION_DISABLE_* switch is set, which keeps the build to minutes on
# 16 cores. Names: backward split paged append local softcap packgqa fp16 fp8 varlen cluster sm80
# hdim64 hdim96 hdim128 hdim192 hdim256 hdimdiff64 hdimdiff192.
set -euo pipefail
archive=$1 dest=$2
enable=" ${FA3_ENABLE:-paged append split packgqa varlen backward hdim128} "
mkdir -p "$dest"
tar -xJf "$archive" -C "$dest"
declare -A switch=([backward]=BACKWARD [split]=SPLIT [paged]=PAGEDKV [append]=APPENDKV
  [local]=LOCAL [softcap]=SOFTCAP [packgqa]=PACKGQA [fp16]=FP16 [fp8]=FP8 [varlen]=VARLEN
  [cluster]=CLUSTER [sm80]=SM80 [hdim64]=HDIM64 [hdim96]=HDIM96 [hdim128]=HDIM128
  [hdim192]=HDIM192 [hdim256]=HDIM256 [hdimdiff64]=HDIMDIFF64 [hdimdiff192]=HDIMDIFF192)
for name in "${!switch[@]}"; do
  [[ "$enable" == *" $name "* ]] || export "FLASH_ATTENTION_DISABLE_${switch[$name]}=TRUE"
done
cd "$dest/fa/hopper"
MAX_JOBS=${MAX_JOBS:-$(nproc)} NVCC_THREADS=${NVCC_THREADS:-2} python3 setup.py build_ext --inplace
