#!/usr/bin/env bash
# A store that lives only in git history (a superseded sweep's, dropped from reports/), made ready to resume from:
#   bash scripts/gpu_state.sh 11799ea:reports/nvidia-h200/sweep-bd8629b/store.sqlite
# writes .gpu_state/<commit>/<path> (git-ignored; a .xz file decompressed, the .xz dropped from its name) and prints
# RESUME_DB=<that file>. scripts/gpu.sh takes RESUME_DB=<commit>:<path> itself and calls this: where the history is
# it unpacks the store; on a device machine, which gets the working tree without its history, it finds the file under
# .gpu_state/ when the call carries that folder (carry: [".gpu_state"]).
set -euo pipefail
spec=${1:-}
commit=${spec%%:*}
path=${spec#*:}
if [ -z "$spec" ] || [ "$commit" = "$spec" ] || [ -z "$commit" ] || [ -z "$path" ]; then
  echo "usage: bash scripts/gpu_state.sh <commit>:<path> (got '${spec}'), e.g. 11799ea:reports/<gpu>/sweep-<sha>/store.sqlite" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
dest=.gpu_state/$commit/${path%.xz}
if [ -f "$dest" ]; then  # unpacked before (here, or carried to a device machine)
  echo "RESUME_DB=$dest"
  exit 0
fi
if ! git rev-parse --git-dir >/dev/null 2>&1; then
  echo "$spec: no git history here and no $dest: run bash scripts/gpu_state.sh $spec where the history is, then carry .gpu_state" >&2
  exit 2
fi
if ! git cat-file -e "$commit:$path" 2>/dev/null; then
  echo "$spec: no such file at commit $commit (reports/<gpu>/RUNS.md, 'Where the older files are', names each path)" >&2
  exit 2
fi
mkdir -p "$(dirname "$dest")"
case $path in
  *.xz) git show "$commit:$path" | xz -dc > "$dest.part" ;;
  *) git show "$commit:$path" > "$dest.part" ;;
esac
mv "$dest.part" "$dest"
echo "RESUME_DB=$dest"
