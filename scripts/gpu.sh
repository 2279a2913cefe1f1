#!/usr/bin/env bash
# The one GPU job: install without deps, build the CUDA extension once, run every test (gpu-marked
# included) and the default benchmark sweep, print each implementation's cost metadata, write
# everything under $OUT (keep it to at most 8 files: a job that brings back more may lose them). The store itself comes
# back as $OUT/store.sqlite; RESUME_DB=path/to/store.sqlite (a carried copy of it) starts from it, so a sweep
# cut by the 10-minute limit goes on in the next call on a fresh machine (export meta.jsonl from it locally).
# RESUME_DB=<commit>:<path> resumes from a store in git history (scripts/gpu_state.sh; carry .gpu_state to a device).
#   device run:   bash scripts/gpu.sh            (stages: build ptxas tests bench bench2 info; pick with args;
#                 also: sanitize (compute-sanitizer on every CUDA kernel), plants (a sweep with planted faulty kernels),
#                 targets (the regret grid and the dispatch cost, decided from bench's store), pack (logs into logs.tar.gz: 8 files come back),
#                 diag (the Triton launch paths' host time), floor (a training step's host floor), ncu (Nsight Compute on the CUDA/Triton bf16 forward),
#                 launch (host us per call per tier and launch layer), dispatch (tiered_ops.<op>'s own per-call cost),
#                 dispatchparts (that cost part by part: the capture query, the C++ key),
#                 firstcall (a first call under background tuning, and the seconds until its decision is stored),
#                 firstcalls (firstcall three ways, each into first_call/<way>/: aside, no-aside, busy),
#                 decoder and models (model-level benchmarks), trainmem (a training step's saved tensors and peak),
#                 compiledmodels (benchmarks/compiled_models.py: each compiled model in its own process; the whole matrix
#                 in 3 calls with --part, its plan in that file's docstring),
#                 stepprof (where a model step's time goes: host, kernels by family, the GPU's idle gaps),
#                 compiled (decisions per call context), sol (benchmarks/speed_of_light.py: the kernels against the copy
#                 bandwidth and the compilers at the cases of benchmarks/speed_of_light.json; SOL_ARGS adds to it),
#                 fleet (benchmarks/fleet.py: two tuning processes, one per GPU, on disjoint buckets through one
#                 PostgreSQL server started here from the carried .whl-pg/ wheels, then a reader with tuning off on each
#                 GPU; into $OUT/fleet/; a 1-GPU host runs both processes on cuda:0 and says so; FLEET_ARGS adds to it),
#                 candidates (scripts/diag's kernel candidates against the ops' own launches, into candidates.txt),
#                 peers (nothing: a call that carries one part of a peer tree, see below))
# Peers: wheels under .whl/ (Liger-Kernel) and .whl-quack/ (quack and the CUTLASS DSL; its CUDA 13 library as a tarball
# under .whl-cutlass/, in parts), downloaded by scripts/fetch_peers.sh, are installed into $PEER_TMP/site
# (PEER_TMP: /tmp) first, so the sweep measures them beside ours. quack on a fresh machine takes four calls in a row
# (a machine idle for 30 s goes back):
#   carry .whl-cutlass/parts/<one part>: bash scripts/gpu.sh peers   (once per part)
#   carry .whl and .whl-quack:           bash scripts/gpu.sh build sol   (or any stages)
#   any GPU box:  OUT=./gpu-out bash scripts/gpu.sh build bench
# Time: DEADLINE (s, default 540) is when the whole call must have packed its files (a device call is cut at 600 s):
# each long stage runs under `timeout` until DEADLINE minus RESERVE (default 45 s: exporting the results and packing),
# and whatever happens, the files under $OUT are packed into at most 8 on exit.
#   the default sweep in two calls:  bash scripts/gpu.sh build bench   then (carrying store.sqlite)
#                                    RESUME_DB=store.sqlite bash scripts/gpu.sh build bench
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STAGES=${*:-build ptxas tests bench bench2 info}
DEADLINE=${DEADLINE:-540}
RESERVE=${RESERVE:-45}
left() { echo $(( DEADLINE - RESERVE - SECONDS )); }  # seconds a stage may still take
# run_for LIMIT CMD...: CMD under timeout (SIGINT first: the bench keeps what it measured; KILL 15 s later)
run_for() { local t=$1; shift; [ "$t" -gt 10 ] || { echo "skipped (no time left before DEADLINE=$DEADLINE): $*"; return 124; }
  timeout -k 15 --signal=INT "$t" "$@"; }
pack() {
  # At most 8 files come back: env, results, meta and the stores stay (their WAL checkpointed into them);
  # everything else goes into logs.tar.gz.
  for db in "$OUT"/store.sqlite "$OUT"/store2.sqlite; do
    [ -f "$db" ] && timeout 30 python3 -c "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); \
c.execute('PRAGMA wal_checkpoint(TRUNCATE)'); c.close()" "$db" && rm -f "$db-wal" "$db-shm"; done
  (cd "$OUT" || exit
   mapfile -t loose < <(find . -mindepth 1 -maxdepth 1 ! -name 'logs*.tar.gz' ! -name env.txt ! -name 'results*.csv' \
     ! -name meta.jsonl ! -name 'store.sqlite*' ! -name 'store2.sqlite' ! -name 'compiled_cache.tar.xz.part*')
   [ ${#loose[@]} -gt 0 ] || exit 0
   mkdir -p .packed  # made first: cp of a single folder into a missing .packed/ would become .packed itself
   [ -f logs.tar.gz ] && tar xzf logs.tar.gz -C .packed  # a second pack keeps the first's logs
   cp -r "${loose[@]}" .packed/
   tar czf /tmp/logs.tar.gz -C .packed . && mv /tmp/logs.tar.gz logs.tar.gz || exit
   # a file over 16 MiB does not come back: then the files under 1 MiB (the results, the logs) come back on their own
   if [ "$(stat -c %s logs.tar.gz)" -gt $(( 15 << 20 )) ]; then
     (cd .packed && find . -type f -size -1024k -print0 | tar czf ../logs-small.tar.gz --null -T -)
     echo "logs.tar.gz is over 15 MiB and will not come back: its files under 1 MiB are in logs-small.tar.gz"
   fi
   rm -rf .packed "${loose[@]}")
  ls "$OUT"
}
trap pack EXIT
# first_call DIR COLD [ARGS...]: benchmarks/first_call.py into DIR/first_call.csv, COLD non-empty: Triton's and Inductor's
# caches empty (new folders), as on a machine that never compiled; its status is the run's.
first_call() {
  local dir=$1 cold=$2; shift 2
  local caches=()
  [ -z "$cold" ] || caches=(TRITON_CACHE_DIR="$(mktemp -d)" TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)")
  run_for "$(left)" env "${caches[@]}" $PY benchmarks/first_call.py --csv "$dir/first_call.csv" "$@" 2>&1 \
    | grep -v -E "UserWarning|warn_once"
  return "${PIPESTATUS[0]}"
}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
# Bytecode of every module imported, kept under /tmp: where the Python packages' folders hold no usable .pyc (a profile on
# an H100 machine compiled 2411 modules from source in one process, 9.7 s), each later process (test workers, the sweep's
# and background tuning's workers) reads it instead of compiling torch again.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE
# The store lives under $OUT: what a call finished comes back even when the call is killed at its limit (with
# its -wal file: open it locally from a writable copy of both).
export TIERED_OPS_DB=${TIERED_OPS_DB:-$OUT/store.sqlite}
export TIERED_OPS_BUILD_DIR=${TIERED_OPS_BUILD_DIR:-/tmp/tiered_ops_build}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${RESUME_DB:-}" ] && [ ! -f "$RESUME_DB" ] && [[ $RESUME_DB == *:* ]]; then
  # <commit>:<path>: a store in git history (a superseded sweep's, no longer in reports/), unpacked under .gpu_state/
  # by scripts/gpu_state.sh, or found there when the call carries .gpu_state (a device machine has no history)
  state=$(bash scripts/gpu_state.sh "$RESUME_DB") || exit 2
  echo "RESUME_DB=$RESUME_DB: ${state#RESUME_DB=}"
  RESUME_DB=${state#RESUME_DB=}
fi
if [ -n "${RESUME_DB:-}" ]; then
  [ -f "$RESUME_DB" ] || { echo "RESUME_DB=$RESUME_DB: no such file (carry it, or give <commit>:<path>)"; exit 2; }
  # a store kept xz-compressed is unpacked here
  case $RESUME_DB in
    *.xz) xz -dc "$RESUME_DB" > "$TIERED_OPS_DB" ;;
    *) cp "$RESUME_DB" "$TIERED_OPS_DB" ;;
  esac && echo "resuming from $RESUME_DB"
fi
PY=python3
rc=0
# The default sweep: inference and training steps, bf16 and fp32 (BENCH_ARGS adds to or overrides it).
SWEEP_ARGS=${SWEEP_ARGS:---mode fwd_nograd,fwd+bwd --dtype bf16,fp32}
# Peer trees packed as .tar.xz under .whl-cutlass/ (the CUTLASS DSL's CUDA 13 library, 92 MB as a wheel, 61 MB packed)
# are unpacked under $PEER_TMP/peer_trees, which stays for the next job on the same machine. Packed, that library still
# does not travel beside the tree, so fetch_peers.sh also splits it into parts (.whl-cutlass/parts/NAME.tar.xz.K-of-N)
# that travel one a call on the same machine (a call that carries one and runs the stage `peers`, which does nothing
# else): each is kept under $PEER_TMP/peer_parts, and the call that finds all N there unpacks the tree.
PEER_TMP=${PEER_TMP:-/tmp}  # where the parts and the trees stay between calls
mkdir -p "$PEER_TMP/peer_trees" "$PEER_TMP/peer_parts"
for part in .whl*/parts/*.tar.xz.*-of-*; do
  [ -f "$part" ] && cp "$part" "$PEER_TMP/peer_parts/" && echo "peer part kept for the next call: $part"
done
# unpack_tree NAME FILE...: the tree packed in FILE... (one .tar.xz, or its parts in order) as $PEER_TMP/peer_trees/NAME
unpack_tree() {
  local d=$PEER_TMP/peer_trees/$1
  shift
  mkdir -p "$d.part" && cat "$@" | tar xJf - -C "$d.part" && mv "$d.part" "$d"
}
# each packed tree once (its name and its count of parts), whichever of its parts are here
while read -r base n; do
  name=$(basename "$base" .tar.xz)
  [ -d "$PEER_TMP/peer_trees/$name" ] && continue
  parts=()
  for ((k = 0; k < n; k++)); do parts+=("$base.$k-of-$n"); done
  if ls "${parts[@]}" > /dev/null 2>&1; then
    unpack_tree "$name" "${parts[@]}" && echo "peer tree unpacked from $n parts: $(basename "$base")"
  else
    echo "peer parts of $(basename "$base") here: $(ls "$base".*-of-"$n" | wc -l) of $n (carry the others)"
  fi
done < <(for f in "$PEER_TMP"/peer_parts/*.tar.xz.*-of-*; do
           [ -f "$f" ] && echo "${f%.*-of-*} ${f##*-of-}"
         done | sort -u)
for t in .whl*/*.tar.xz; do
  [ -f "$t" ] || continue
  name=$(basename "$t" .tar.xz)
  [ -d "$PEER_TMP/peer_trees/$name" ] || { unpack_tree "$name" "$t" && echo "peer tree unpacked: $t"; }
done
wheels=$(ls .whl/*.whl .whl-quack/*.whl 2>/dev/null)
if [ -n "$wheels" ] || ls -d "$PEER_TMP"/peer_trees/*/ > /dev/null 2>&1; then
  [ -z "$wheels" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$PEER_TMP/site" $wheels && echo "peers installed: $(basename -a $wheels | tr '\n' ' ')"; }
  for d in "$PEER_TMP"/peer_trees/*/; do [ -d "$d" ] && mkdir -p "$PEER_TMP/site" && cp -a "$d". "$PEER_TMP/site/"; done
  export PYTHONPATH=$PEER_TMP/site:$PYTHONPATH
  # the path the CUTLASS DSL's .pth file adds in a site directory (a --target folder on PYTHONPATH reads no .pth)
  dsl=$PEER_TMP/site/nvidia_cutlass_dsl/dsl_packages
  [ -d "$dsl" ] && export PYTHONPATH=$PYTHONPATH:$dsl
fi
{
  # TIERED_OPS_TREE: the commit whose tree was copied here, where the copy's own git names an older base
  echo "# $(date -u +%FT%TZ) scripts/gpu.sh $STAGES  (git ${TIERED_OPS_TREE:-$(git rev-parse --short HEAD 2>/dev/null || echo none)$(git diff --quiet 2>/dev/null || echo +dirty)})"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
} | tee "$OUT/env.txt"

for stage in $STAGES; do
  case $stage in
    build)
      echo "== build"
      $PY - <<'PY' 2>&1 | tee "$OUT/build.log" || rc=1
import time, torch
from tiered_ops.tiers import cuda_ext
t = time.time()
err = cuda_ext.load()
print("cuda extension:", err or f"built and loaded in {time.time() - t:.1f} s ({cuda_ext._state.get('name')})")
raise SystemExit(1 if err else 0)
PY
      ;;
    ptxas)
      # Registers and spills per kernel, as ptxas reports them for this GPU's architecture.
      arch=$($PY -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability())))")
      for f in cuda_src/*.cu; do
        nvcc -c -O3 -std=c++17 -gencode=arch=compute_$arch,code=sm_$arch -Xptxas -v "$f" -o /tmp/$(basename "$f").o 2>&1 \
          | grep -E "Compiling entry|registers|spill" ; done > "$OUT/ptxas.txt" 2>&1
      ;;
    tests)
      echo "== tests (all, gpu-marked included)"
      # TEST_ARGS: the selection (default: the gpu-marked tests over 8 workers, each test at most 120 s; the whole
      # suite with -n 8 does not end within one call)
      # -rs lists every skip with its reason: a gpu-marked test that skips on a GPU machine did not run, and the
      # default selection (gpu-marked tests only) fails the stage when one did.
      # The tests marked alone (they assert on a kernel's duration) run after the others, one at a time: beside seven
      # workers' kernels on the same GPU a 120 ms sleep's probes waited past the test's 120 s limit.
      if [ -n "${TEST_ARGS:-}" ]; then
        run_for "$(left)" $PY -m pytest $TEST_ARGS -q -rfEs --durations=15 -p no:cacheprovider 2>&1 \
          | tee "$OUT/pytest.log" | tail -40
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      else
        run_for "$(left)" $PY -m pytest -n 8 -m "gpu and not alone" tests --timeout=120 -q -rfEs --durations=15 \
          -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        run_for "$(left)" $PY -m pytest -m "gpu and alone" tests --timeout=120 -q -rfEs -p no:cacheprovider 2>&1 \
          | tee "$OUT/pytest_alone.log" | tail -3
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      fi
      if [ -z "${TEST_ARGS:-}" ] && tail -q -n 1 "$OUT/pytest.log" "$OUT/pytest_alone.log" | grep -q skipped; then
        echo "gpu-marked tests skipped on this GPU machine (SKIPPED lines in pytest*.log): they did not run"; rc=1
      fi
      # The C++ call key's own tests under this host's Python (3.12: the vectorcall on every call site and the C-side
      # cache, which a CPU machine on 3.11 never runs), unless TEST_ARGS chose the selection.
      if [ -z "${TEST_ARGS:-}" ]; then
        run_for "$(left)" $PY -m pytest tests/test_call_key.py -q -rfE -p no:cacheprovider 2>&1 \
          | tee "$OUT/pytest_call_key.log" | tail -3
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        # The unmarked tests that take another branch where there is a GPU (they read HAS_CUDA, or run each tier on
        # device_for(tier): the GPU here, the interpreter on the CPU): -m gpu leaves them out, and the CPU suite runs
        # their other branch.
        mapfile -t branching < <(grep -l -E "HAS_CUDA|device_for" tests/test_*.py)
        run_for "$(left)" $PY -m pytest -n 8 -m "not gpu" "${branching[@]}" --timeout=180 -q -rfE -p no:cacheprovider \
          2>&1 | tee "$OUT/pytest_cuda_branches.log" | tail -3
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      fi
      ;;
    bench)
      echo "== bench (default sweep, every mode unless BENCH_ARGS says otherwise)"
      # BENCH_TIMEOUT (s): stop the sweep there and still export. Every finished measurement is already in the
      # store, so running the stage again on the same machine resumes where it stopped. BENCH_ARGS: extra
      # arguments of `tiered-ops bench` (e.g. --mode fwd_nograd,fwd+bwd --dtype bf16).
      t=$(left); [ -n "${BENCH_TIMEOUT:-}" ] && [ "$BENCH_TIMEOUT" -lt "$t" ] && t=$BENCH_TIMEOUT
      run_for "$t" $PY -m tiered_ops bench --no-progress $SWEEP_ARGS \
        ${BENCH_ARGS:-} 2>&1 | grep --line-buffered -v -E "UserWarning|warn_once|If it is a" | tee "$OUT/bench.log"
      [ "${PIPESTATUS[0]}" = 0 ] || { rc=1; echo "bench stopped before the end: run the stage again (RESUME_DB) to resume"; }
      timeout 60 $PY -m tiered_ops export --csv "$OUT/results.csv" --meta "$OUT/meta.jsonl" || rc=1
      ;;
    bench2)
      # The same sweep measured again (--force) into a second store: `tiered-ops report --repeat` turns the pair
      # into the agreement rate of non-tied decisions.
      echo "== bench, second time (for the agreement rate)"
      # STORE2: where the second store lives (a path outside $OUT survives to the next call on a warm machine).
      store2=${STORE2:-$OUT/store2.sqlite}
      t=$(left); [ -n "${BENCH_TIMEOUT:-}" ] && [ "$BENCH_TIMEOUT" -lt "$t" ] && t=$BENCH_TIMEOUT
      TIERED_OPS_DB=$store2 run_for "$t" $PY -m tiered_ops bench \
        --no-progress $SWEEP_ARGS ${BENCH_ARGS:-} > "$OUT/bench2.log" 2>&1 || rc=1
      tail -2 "$OUT/bench2.log"
      TIERED_OPS_DB=$store2 timeout 60 $PY -m tiered_ops export --csv "$OUT/results-run2.csv" || rc=1
      ;;
    targets)
      echo "== targets: regret grid + dispatch cost, decided from $TIERED_OPS_DB"
      t=$(left); [ -n "${TARGETS_TIMEOUT:-}" ] && [ "$TARGETS_TIMEOUT" -lt "$t" ] && t=$TARGETS_TIMEOUT
      # TARGETS_GRID=none: the dispatch cost alone
      grid=${TARGETS_GRID:-benchmarks/grid.csv}
      run_for "$t" $PY -m tiered_ops --db "$TIERED_OPS_DB" targets --live \
        $([ "$grid" = none ] || echo --grid "$grid") --spec benchmarks/targets.json --out-dir "$OUT/targets" \
        $([ -f "$OUT/results.csv" ] && echo --results "$OUT/results.csv") \
        2>&1 | grep -v -E "UserWarning|warn_once|If it is a" | tee "$OUT/targets.log" | grep -E "regret|NOT met|wrote" 
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      rm -f "$OUT/targets/grid.sqlite"* "$OUT/targets/tuned.sqlite"*
      ;;
    pack)
      pack  # also done on exit
      ;;
    info)
      echo "== info (graph breaks and maintenance cost per implementation)"
      for op in $($PY -c "from tiered_ops.tiers.catalog import all_ops; print(*(s.name for s in all_ops()))"); do
        $PY -m tiered_ops info "$op" || rc=1; done 2>&1 \
        | tee "$OUT/info.txt"
      ;;
    sanitize)
      # Every CUDA kernel, fwd and bwd, edge + default problems, 3 dtypes, under each compute-sanitizer tool, one
      # log. SAN_MAX_<TOOL> caps the elements per problem (racecheck tracks every shared-memory access: slow); SAN_ARGS
      # adds to scripts/sanitize.py's arguments (e.g. --ops segment_sum,cross_entropy).
      : > "$OUT/sanitizer.log"
      for tool in ${SANITIZERS:-memcheck racecheck initcheck}; do
        cap_var=SAN_MAX_${tool^^}; cap=${!cap_var:-$((1 << 26))}
        echo "== compute-sanitizer --tool $tool (problems up to $cap elements)" | tee -a "$OUT/sanitizer.log"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SAN_TIMEOUT:-900}" compute-sanitizer --tool "$tool" \
          --error-exitcode 1 --print-limit 20 $PY scripts/sanitize.py --max-elements "$cap" ${SAN_ARGS:-} >> "$OUT/sanitizer.log" 2>&1
        r=$?; echo "== $tool exit $r" | tee -a "$OUT/sanitizer.log"; [ $r = 0 ] || rc=1
        grep -E "ERROR SUMMARY|cases ran" "$OUT/sanitizer.log" | tail -2
      done
      # Positive control: the same memcheck run on the planted out-of-bounds kernel must report it.
      echo "== positive control: memcheck on tests/plants cuda_oob (must report an invalid write)" \
        | tee -a "$OUT/sanitizer.log"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
        --print-limit 2 $PY scripts/sanitize.py --plant-oob > /tmp/control.log 2>&1
      r=$?; grep -E "Invalid __global__|ERROR SUMMARY" /tmp/control.log | head -3 | tee -a "$OUT/sanitizer.log"
      if [ $r != 0 ] && grep -q "Invalid __global__ write" /tmp/control.log; then
        echo "== positive control: caught (exit $r)" | tee -a "$OUT/sanitizer.log"
      else
        echo "== positive control FAILED: memcheck did not report the planted write (exit $r)" | tee -a "$OUT/sanitizer.log"
        rc=1
      fi
      ;;
    plants)
      # The default fp32 forward sweep of every op plus the planted faulty kernels (tests/plants), isolated: each
      # plant must cost one candidate, with its reason, and the sweep must finish. Its own store (not $OUT's).
      echo "== sweep with planted crashing / hanging / uncompilable kernels"
      $PY -m tiered_ops --db /tmp/plants.sqlite bench --import tests.plants --dtype fp32 --mode fwd_nograd \
        --timeout "${PLANT_TIMEOUT:-90}" --no-progress ${PLANT_ARGS:-} 2>&1 | tee "$OUT/plants.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      ;;
    launch)
      # Host us per call of every tier in fwd_nograd and fwd+bwd at the launch-bound shapes, next to eager and to the
      # launch layers (bare launch, cached launch, CUDA-graph replay).
      echo "== launch: host time per call, tier by tier and layer by layer"
      timeout "${LAUNCH_TIMEOUT:-300}" $PY scripts/diag/launch_layers.py 2>&1 | grep -v -E "UserWarning|warn_once" \
        | tee "$OUT/launch_layers.txt" | tail -30
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      ;;
    dispatch)
      # tiered_ops.<op> and a select_backend callable minus the chosen implementation called directly, per op at its
      # launch-bound shape (target: <= 1 us on the GPU host).
      # The chosen implementations called (keyed in C++: the extension is built; each bucket tuned first where the
      # store has none; 300 rounds, and more while a median's 95% interval is wider than +-0.1 us, for at most 60 s per
      # op: their host time varies by more than the difference measured), then a stub in their place (the dispatch's own
      # cost, warm and with 16 MB streamed through the CPU caches before each call), then the stub keyed in Python (a
      # process without the extension).
      echo "== dispatch: per-call overhead"
      for v in ":--tune --rounds 300 --until-ci 0.1 --max-s 60" "_stub:--stub --evict 16" \
               "_stub_python_key:--stub --python-key"; do
        run_for "$(left)" $PY benchmarks/dispatch_overhead.py --csv "$OUT/dispatch_overhead${v%%:*}.csv" ${v#*:} 2>&1 \
          | grep -v -E "UserWarning|warn_once" | tail -20
      done
      ;;
    dispatchparts)
      # The public call's host time over its implementation part by part (the capture query, the C++ key), on the
      # default stream and on a side stream.
      echo "== dispatchparts: the per-call path part by part"
      run_for "$(left)" $PY scripts/diag/dispatch_parts.py --csv "$OUT/dispatch_parts.csv" 2>&1 \
        | grep -v -E "UserWarning|warn_once" | tail -10
      ;;
    firstcall)
      # A first call with an empty store under background tuning: its latency beside eager's first call, and the
      # seconds until its bucket's decision is stored (targets: <= eager + 50 ms; <= 3 s median, <= 8 s max).
      # FIRSTCALL_COLD=1: Triton's and Inductor's caches empty too (new folders), as on a machine that never compiled.
      # FIRSTCALL_ARGS adds to the command (--busy: the op keeps being called beside a matrix product while it tunes;
      # --blocking-only: blocking tuning alone, in background tuning's worker and gate helpers (the default);
      # TIERED_OPS_BLOCKING_ASIDE=0 before the command: in the calling process, for an A/B).
      echo "== firstcall: background tuning from an empty store${FIRSTCALL_COLD:+, empty compile caches}"
      first_call "$OUT" "${FIRSTCALL_COLD:-}" ${FIRSTCALL_ARGS:-} | tail -14
      ;;
    firstcalls)
      # The first call three ways, one after another on this machine, each into $OUT/first_call/<way>/: aside (empty
      # compile caches, first calls made in the gate helpers), no-aside (the same with TIERED_OPS_FIRST_CALLS_ASIDE=0:
      # what making them aside saves), busy (--busy: the op called beside a matrix product while it tunes; the caches
      # as the runs before left them). Each way's figures against blocking tuning's are its last lines. FIRSTCALL_ARGS
      # adds to each (e.g. --ops gelu,muladd).
      for way in aside no-aside busy; do
        d="$OUT/first_call/$way"
        mkdir -p "$d"
        echo "== firstcalls: $way"
        # the switch set for this run alone (an assignment before a function call), not exported to later stages
        TIERED_OPS_FIRST_CALLS_ASIDE=$([ "$way" = no-aside ] && echo 0 || echo 1) \
          first_call "$d" "$([ "$way" = busy ] || echo cold)" $([ "$way" = busy ] && echo --busy) ${FIRSTCALL_ARGS:-} \
          | tee "$d/first_call.log" | tail -3
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done
      ;;
    decoder)
      # The plain-torch decoder (2 layers at 8B dimensions) with tiered_ops ops and torch's, eager / compiled / graphed.
      echo "== decoder: model-level contexts"
      timeout "${DECODER_TIMEOUT:-400}" $PY benchmarks/decoder.py --out-dir "$OUT" --reps "${DECODER_REPS:-20}" 2>&1 \
        | grep -v -E "UserWarning|warn_once" | tee "$OUT/decoder.log" | tail -25
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      ;;
    models)
      # transformers models from configs: stock, its unpatched copy (the control), tiered_ops (with and without
      # fuse_residual), Liger; one run of
      # benchmarks/models.py per model into $OUT/models/<model>/ (each writes its rows as it goes: a model cut by the
      # deadline keeps what it finished). An 8B-dimension model takes ~5 min on an H100, GPT-2 small ~3: MODELS picks.
      echo "== models: stock vs tiered_ops vs Liger"
      for m in ${MODELS:-llama-8b-dims-2l qwen3-8b-dims-2l gpt2-small}; do
        mkdir -p "$OUT/models/$m"
        run_for "$(left)" $PY benchmarks/models.py --models "$m" --out-dir "$OUT/models/$m" ${MODELS_ARGS:-} 2>&1 \
          | grep -v -E "UserWarning|warn_once" | tee "$OUT/models/$m/models.log" | grep -E "8b-dims|gpt2|wrote"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done
      ;;
    compiledmodels)
      # benchmarks/compiled_models.py: stock vs tiered_ops.patch in the natural flow (fresh store, patch -> compile ->
      # call), each compiled model in its own process, graph breaks and recompiles per row, into
      # $OUT/compiled_models/ (rows and compiled_models_events.csv, every worker request's span, written as rows
      # finish); no batch of rows started that the longest batch so far would carry past the stage's limit less 30 s.
      # COMPILED_MODELS_ARGS adds to it: --part I/N (the I-th of N calls covering the plan once), --parallel K (rows
      # whose workers start and compile at once, then are timed one row at a time), --done CSV (repeatable: rows a call
      # finished, skipped), --configs, --modes, --workloads, --variants stock,stock-copy,tiered for the control.
      # The plan of calls is in the module's docstring. COMPILED_MODELS_CARRY=1: every tiered worker uses $TIERED_OPS_DB
      # (the store that comes back; RESUME_DB carries it into the next call, whose rows then say "carried").
      # Inductor's and Triton's caches live in COMPILED_MODELS_CACHE_DIR (default /tmp/compiled_models_cache: a warm
      # machine keeps it from call to call); COMPILED_MODELS_CACHE=FILE (a carried compiled_cache.tar.xz from an earlier
      # call's parts, joined: cat compiled_cache.tar.xz.part* > compiled_cache.tar.xz) is unpacked into it first, and
      # the folder comes back packed, in files of 15 MiB (compiled_cache.tar.xz.part0...; beside logs.tar.gz, never in
      # it: one file over 16 MiB does not come back) where it is at most COMPILED_MODELS_CACHE_MB (default 44: a call
      # carries 64 MiB in all).
      # A cache that was not empty makes first calls load compiled code: the rows' header says how many files it held.
      echo "== compiledmodels: the compiled-model matrix"
      mkdir -p "$OUT/compiled_models"
      cache=${COMPILED_MODELS_CACHE_DIR:-/tmp/compiled_models_cache}
      mkdir -p "$cache/inductor" "$cache/triton"
      if [ -n "${COMPILED_MODELS_CACHE:-}" ]; then
        if [ -f "$COMPILED_MODELS_CACHE" ]; then
          timeout 60 tar xJf "$COMPILED_MODELS_CACHE" -C "$cache" && echo "compile caches restored from $COMPILED_MODELS_CACHE"
        else echo "COMPILED_MODELS_CACHE=$COMPILED_MODELS_CACHE: no such file (carry it); caches as this machine has them"
        fi
      fi
      t=$(left)
      TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton run_for "$t" $PY \
        benchmarks/compiled_models.py --out-dir "$OUT/compiled_models" --deadline-s $(( t - 30 )) \
        ${COMPILED_MODELS_CARRY:+--store "$TIERED_OPS_DB"} ${COMPILED_MODELS_ARGS:-} 2>&1 \
        | grep -v -E "UserWarning|warn_once|warnings.warn" | tee "$OUT/compiled_models/compiled_models.log" \
        | grep -E "first call|  (stock|tiered)|wrote|deadline|failed"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      packed=/tmp/compiled_cache.tar.xz
      if timeout 40 bash -c 'tar cf - -C "$1" inductor triton | xz -T0 -3 > "$2"' _ "$cache" "$packed"; then
        mb=$(( $(stat -c %s "$packed") >> 20 ))
        if [ "$mb" -gt "${COMPILED_MODELS_CACHE_MB:-44}" ]; then
          echo "compile caches not brought back: $mb MiB packed"
        else  # files of 15 MiB at most (16 MiB is the most one file may have to come back), beside logs.tar.gz
          split -b 15M -d -a 1 "$packed" "$OUT/compiled_cache.tar.xz.part"
          echo "compile caches packed: $mb MiB in compiled_cache.tar.xz.part* (cat them into compiled_cache.tar.xz)"
        fi
      else echo "compile caches not brought back: packing them failed or took over 40 s"; fi
      rm -f "$packed"
      ;;
    trainmem)
      # Where a training step's memory goes, stock against patched (benchmarks/train_memory.py): decisions, tensors
      # saved for the backward, peak; per model of TRAINMEM_MODELS, in each context of TRAINMEM_CONTEXTS (default
      # compile and eager); TRAINMEM_ARGS adds to it (--held-grads, --at-peak, --variants).
      for m in ${TRAINMEM_MODELS:-qwen3-8b-dims-2l}; do
        for ctx in ${TRAINMEM_CONTEXTS:-compile eager}; do
          run_for "$(left)" $PY benchmarks/train_memory.py --model "$m" --context $ctx ${TRAINMEM_ARGS:-} 2>&1 \
            | grep -v -E "UserWarning|warn_once|warnings.warn" | tee "$OUT/train_memory-$m-$ctx.txt" || rc=1
        done
      done
      ;;
    stepprof)
      # Where one model step's time goes, per variant (benchmarks/step_profile.py: step and host time, kernels by
      # family, top kernels, one step's trace into step_traces/ and its idle gaps); STEPPROF_ARGS picks (default: Llama 8B dims, 2 layers, a training step in eager).
      run_for "$(left)" $PY benchmarks/step_profile.py --trace "$OUT/step_traces" ${STEPPROF_ARGS:-} 2>&1 \
        | grep -v -E "UserWarning|warn_once|warnings.warn" | tee "$OUT/step_profile.txt" || rc=1
      ;;
    compiled)
      # Decisions of a compiled caller: each implementation measured inside a compiled function (between pointwise
      # ops) at the launch-bound shapes, bf16, inference; the rows land in the store with context 'compiled'. One
      # process for every case (a process per case spent most of a call importing and compiling), under DEADLINE.
      echo "== compiled: decisions per context"
      run_for "$(left)" $PY - <<'PY' 2>&1 | tee "$OUT/contexts.txt" || rc=1
import os
from tiered_ops import select_backend
from tiered_ops.tiers.catalog import all_ops
ops = os.environ.get("COMPILED_OPS", "").split() or [s.name for s in all_ops()]
for op in ops:
    for shape in os.environ.get("COMPILED_SHAPES", "1x4096 32x4096 16384x4096").split():
        for ctx in ("compiled", "eager", "graphed"):  # compiled first: a decision makes every context's at once
            try:
                sel = select_backend(op, tuple(map(int, shape.split("x"))), "bf16", "cuda", context=ctx)
            except Exception as e:  # a case that fails is a result: said, and the next one goes on
                print(f"{op} {shape} bf16 fwd_nograd {ctx}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            print(f"{op} {shape} bf16 fwd_nograd {ctx} [{sel.record['policy']}]: {sel.name} ({sel.tier.label}) - "
                  f"{sel.record['reason']}", flush=True)
PY
      timeout 120 $PY -m tiered_ops export --context compiled --csv "$OUT/results-compiled.csv" || rc=1
      ;;
    sol)
      # Each speed-of-light case measured with every implementation (gated), into the store (a cut run goes on from
      # it), then the verdicts: sol/speed_of_light.{md,csv}.
      echo "== speed of light"
      mkdir -p "$OUT/sol"
      run_for "$(left)" $PY benchmarks/speed_of_light.py --out-dir "$OUT/sol" --db "$TIERED_OPS_DB" ${SOL_ARGS:-} 2>&1 \
        | grep -v -E "UserWarning|warn_once" | tee "$OUT/sol/sol.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      ;;
    floor)
      # The host floor of a training step (a step that launches nothing) beside the norms' own steps.
      echo "== floor: a training step's host floor"
      run_for "$(left)" $PY scripts/diag/step_floor.py --rounds "${FLOOR_ROUNDS:-7}" 2>&1 \
        | grep -v -E "UserWarning|warn_once" | tee "$OUT/step_floor.txt" | tail -20
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      ;;
    diag)
      # Where the Triton tier's per-call host time goes, layer by layer.
      echo "== diag: Triton launch paths"
      $PY scripts/diag/triton_launch.py 2>&1 | grep -v -E "UserWarning|warn_once" | tee "$OUT/diag.txt" || rc=1
      ;;
    candidates)
      # The standalone candidates (scripts/diag/*.cu that time a kernel design against the op's own launch in one
      # process) at the cases their benchmarks/PERF_LOG.md entries name, built for this GPU: one log. CAND_ONLY:
      # some of them (softmax_l2, layer_norm_l2). Each case is cut at 120 s: a persistent
      # candidate whose blocks are not all resident waits forever.
      echo "== candidates"
      arch=$($PY -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability())))")
      [ "$arch" -ge 90 ] && arch=${arch}a
      declare -A cases=(
        [softmax_l2]="512,393216 4096,393216 512,393216,bf16 4096,65536 1024,131072 12,250000"
        [layer_norm_l2]="16,4194304 64,1048576"
      )
      for name in ${CAND_ONLY:-softmax_l2 layer_norm_l2}; do
        echo "-- $name (sm_$arch)"
        nvcc -O3 -std=c++17 -gencode=arch=compute_$arch,code=sm_$arch -I cuda_src -I scripts/diag \
          "scripts/diag/$name.cu" -o "/tmp/$name" || { rc=1; continue; }
        for c in ${cases[$name]}; do
          [ "$(left)" -gt 20 ] || { echo "skipped $name $c: no time left before DEADLINE=$DEADLINE"; continue; }
          timeout -k 5 120 "/tmp/$name" ${c//,/ } || { echo "$name $c: exit $?"; rc=1; }
        done
      done > "$OUT/candidates.txt" 2>&1  # not through a pipe: rc stays this shell's
      cat "$OUT/candidates.txt"
      ;;
    ncu)
      # Nsight Compute (clocks as they run) on a set of scripts/diag/ncu_cases.py: NCU_SET=bf16 (the default: the
      # CUDA v2 forward vs Triton at the bf16 gap) or sol (the speed-of-light cases whose bars are not met).
      # NCU_REPLAY=application reruns the script for each pass instead of saving and restoring memory around a kernel
      # (the persistent kernels' durations under kernel replay disagree with their timed medians); NCU_METRICS adds
      # metrics (e.g. dram__bytes_read.sum,dram__bytes_write.sum). softmax's cluster kernel fails under either replay
      # (the profiled launch loses its clusters): scripts/diag/softmax_plans.cu with NCU_PLAN=1 profiles it.
      ncu_set=${NCU_SET:-bf16}
      ncu_replay=${NCU_REPLAY:-kernel}
      echo "== ncu ($ncu_set, $ncu_replay replay)"
      timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none --replay-mode "$ncu_replay" \
        ${NCU_METRICS:+--metrics "$NCU_METRICS"} --nvtx --nvtx-include "prof/" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats $PY scripts/diag/ncu_cases.py --set "$ncu_set" > "$OUT/ncu.txt" 2>&1 || rc=1
      grep -E "profiled case|, Context|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|Registers Per" \
        "$OUT/ncu.txt" | head -150
      ;;
    fleet)
      echo "== fleet: two tuning processes, one PostgreSQL store, a reader that measures nothing"
      # The server and its driver travel as wheels (bash scripts/fetch_peers.sh --pg; carry .whl-pg), installed once
      # per machine into $PEER_TMP/pg_site; the server's binaries run as postgres or nobody under root (tests/pgserver.py)
      pgsite=$PEER_TMP/pg_site
      if [ ! -d "$pgsite" ] && ls .whl-pg/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$pgsite.part" .whl-pg/*.whl \
          && mv "$pgsite.part" "$pgsite" && chmod -R a+rX "$pgsite" && echo "PostgreSQL wheels installed: $pgsite"
      fi
      if [ ! -x "$pgsite/pgserver/pginstall/bin/pg_ctl" ]; then
        echo "fleet: no PostgreSQL here (run bash scripts/fetch_peers.sh --pg and carry .whl-pg)"; rc=1
      else
        ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
        if [ "$ngpu" = 1 ]; then echo "fleet: one GPU on this host: both tuning processes on cuda:0"; fi
        mkdir -p "$OUT/fleet"
        PATH=$pgsite/pgserver/pginstall/bin:$PATH PYTHONPATH=$pgsite:$PYTHONPATH run_for "$(left)" \
          $PY benchmarks/fleet.py --out "$OUT/fleet" ${FLEET_ARGS:-} 2>&1 \
          | grep --line-buffered -v -E "UserWarning|warn_once|If it is a" | tee "$OUT/fleet/fleet.log" | tail -30
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      fi
      ;;
    peers) ;;  # a call that carries a peer part (above) and nothing more
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
