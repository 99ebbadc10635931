#!/usr/bin/env bash
# Fails when the repository's tree is larger than LIMIT_BYTES. The tree that a checkout of the
# repository is copied as (to a test machine, for one) is its working tree: the tracked files and
# the untracked ones git does not ignore, each counted by its own size, a symbolic link as a link
# (lstat). That copy is limited to 64 MiB; the limit here, 49 MiB, leaves 15 MiB of it to what a
# run adds beside the tree (the GPU check's bundle, scripts/gpu_bundle.sh: 13.9 MiB).
# tests/golden/README.md says how the golden data stays within it.
#   usage: bash scripts/check_tree_size.sh [SOURCE_DIR]   (default: this script's repository)
# The tree is what git lists: outside a git checkout (an exported source tree) the check fails
# rather than guess which files would travel.
set -euo pipefail
LIMIT_BYTES=$((49 * 1024 * 1024))
SOURCE_DIR=${1:-$(dirname "$0")/..}
cd "$SOURCE_DIR"
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "tree size: $(pwd) is not a git checkout; the size of the tree is measured on the files git lists" >&2
  exit 1
fi
cd "$(git rev-parse --show-toplevel)"
# stat without -L: a link's own size. A tracked file deleted in the working tree does not travel
# (stat fails on it, and says nothing).
sizes=$(git ls-files -z --cached --others --exclude-standard | { xargs -0 -r stat -c '%s %n' -- 2>/dev/null || true; })
total=$(awk '{ sum += $1 } END { print sum + 0 }' <<<"$sizes")
mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "tree size: $(mib "$total") ($total bytes) is over the limit of $(mib "$LIMIT_BYTES")." >&2
  echo "The largest files (tests/golden/README.md says how the golden data is kept small):" >&2
  sort -rn <<<"$sizes" | head -n 5 >&2
  exit 1
fi
echo "tree size: $(mib "$total") ($total bytes), within $(mib "$LIMIT_BYTES")"
