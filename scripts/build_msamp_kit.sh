#!/bin/bash
# Recreate .msampkit/ (kept out of git) from the MS-AMP source: what the GPU machine needs to
# build MS-AMP on a current stack (torch 2.11 + CUDA 13), see docs/msamp.md.
#
#     bash scripts/build_msamp_kit.sh [MS-AMP git dir or checkout]   # default: the local mirror
#
# .msampkit/ then holds:
#   upstream/             MS-AMP as released (msamp/ and its setup files; no docs, tests, third_party)
#   current-stack.patch   fp8plug's small patch for torch 2.11 / TransformerEngine 2.x (from scripts/msamp_kit/)
#   patched/              upstream/ with the patch applied (what build.sh builds)
#   build.sh, smoke.py    the GPU-machine build and its smoke checks (from scripts/msamp_kit/)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
source_repo=${1:-/work/.mirror/Azure+MS-AMP/repo}
commit=9746ea8  # MS-AMP main as mirrored (2025: "Add Support for msamp FP4 Quantization")
kit=$root/.msampkit
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if git -C "$source_repo" rev-parse --verify -q "$commit^{commit}" > /dev/null; then
  git -C "$source_repo" archive "$commit" | tar -x -C "$tmp"
else
  echo "$source_repo has no commit $commit; taking its HEAD" >&2
  git -C "$source_repo" archive HEAD | tar -x -C "$tmp"
fi

rm -rf "$kit"
mkdir -p "$kit/upstream"
for item in msamp LICENSE README.md pyproject.toml setup.py MANIFEST.in; do
  cp -r "$tmp/$item" "$kit/upstream/"
done
cp -r "$kit/upstream" "$kit/patched"
cp "$root/scripts/msamp_kit/current-stack.patch" "$root/scripts/msamp_kit/build.sh" "$root/scripts/msamp_kit/smoke.py" "$kit/"
(cd "$kit/patched" && patch -p1 --no-backup-if-mismatch -s < "$kit/current-stack.patch")
find "$kit" -name '__pycache__' -prune -exec rm -rf {} +
echo "MS-AMP kit in $kit ($(du -sh "$kit" | cut -f1)); on the GPU machine: bash .msampkit/build.sh"
