#!/usr/bin/env bash
# The backward, old against new, on the GPU: builds tools/bwd_ab.cu (a timer of
# launch_flash_bwd alone) twice for one architecture -- against this tree's csrc/ and against
# csrc/ of an earlier commit, extracted with git archive -- and runs both on the same shapes,
# one table each, then the ratio old / new per shape. Only the d = 64 and 128 tiles are built
# (FMHA_CUDA_HDIM_MASK), so each build takes ~1 minute on 16 cores.
#
#   tools/bwd_ab.sh ARCH OUT_DIR [OLD_REV]
#   tools/bwd_ab.sh --old-rev             prints the default OLD_REV
#
# OLD_REV defaults to the parent of the commit that gave the main backward kernel its warp
# count per head dim (the last commit of the 4-warp design); any revision whose
# csrc/cuda/flash_bwd.h declares launch_flash_bwd(const BwdParams&, void*) works.
set -eu -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
default_old_rev() {
  local c
  c="$(git log -n1 --format=%H -S'static constexpr int kWarps = !kExtras_' -- csrc/cuda/flash_bwd.cuh)"
  [[ -n "$c" ]] || { echo "bwd_ab: no commit gives the backward its warp count per head dim" >&2; exit 2; }
  git rev-parse "$c^"
}
if [[ "${1:-}" == --old-rev ]]; then default_old_rev; exit 0; fi
arch="$1" out="$2"
old_rev="${3:-$(default_old_rev)}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# build NAME SRC_ROOT: the timer against SRC_ROOT/csrc, objects compiled in parallel.
build() {
  local name="$1" src="$2" obj="$out/obj-$1"
  mkdir -p "$obj"
  local files=("$ROOT/tools/bwd_ab.cu" "$src/csrc/cuda/flash_bwd.cu" "$src/csrc/fmha/validate.cpp")
  for t in 64 128; do
    files+=("$src"/csrc/cuda/instantiations/flash_bwd_hdim${t}_*.cu)
  done
  printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -I{} sh -c \
    '"$0" -std=c++17 -O3 -DNDEBUG -DFMHA_CUDA_HDIM_MASK=10 -arch=sm_$1 -I"$2/csrc" \
       -I"$2/third_party" -c "{}" -o "$3/$(basename "{}").o"' "$NVCC" "$arch" "$src" "$obj"
  "$NVCC" -arch=sm_"$arch" "$obj"/*.o -o "$out/bwd_ab_$name"
}

old_src="$out/old-src"
rm -rf "$old_src" && mkdir -p "$old_src"
git archive "$old_rev" csrc third_party | tar -x -C "$old_src"
echo "bwd_ab: old = $(git rev-parse --short "$old_rev"), new = this tree ($(git rev-parse --short HEAD)$(git diff --quiet -- csrc || echo ', modified'))"
build old "$old_src"
build new "$ROOT"
"$out/bwd_ab_old" | tee "$out/bwd_old.tsv"
"$out/bwd_ab_new" | tee "$out/bwd_new.tsv"
echo "shape	old ms	new ms	old / new"
paste "$out/bwd_old.tsv" "$out/bwd_new.tsv" | tail -n +2 |
  awk -F'\t' '{printf "%s\t%s\t%s\t%.3f\n", $1, $2, $5, $2 / $5}'
