#!/bin/sh
# The CUDA compiler launcher of fmha_cuda (CMakeLists.txt): runs one nvcc command and keeps
# ptxas's resource report of its object (-Xptxas -v: registers, stack frame and spills of
# every kernel, per architecture) as <dir>/<object>.txt, which the package installs
# (fmha/_ptxas/) and tests/native/test_cuda_emu.py reads: the shipped kernels are checked as built.
# Every other line of the compiler's output passes through, so the build log is unchanged.
# Usage: ptxas_report.sh <dir> <compiler> <arguments...>
dir=$1
shift
obj=
prev=
for arg in "$@"; do
  [ "$prev" = "-o" ] && obj=$arg
  prev=$arg
done
mkdir -p "$dir"
report="$dir/$(basename "$obj").txt"
"$@" >"$report.tmp" 2>&1
status=$?
grep -v -E '^(ptxas info|    [0-9]+ bytes stack frame)' "$report.tmp" >&2
if [ "$status" -eq 0 ]; then
  mv "$report.tmp" "$report"
else
  rm -f "$report.tmp" "$report"
fi
exit "$status"
