#!/usr/bin/env bash
# tern's GPU check, run from the kit that `cargo xtask gpu-kit` builds (target/gpu-kit/), on a
# machine with an NVIDIA GPU and driver and no Rust toolchain. cuda/README.md says how to run it
# through the device tool and what each step checks.
#
# Steps, most important first, each under a timeout taken from one overall budget, each one
# run whatever became of the ones before it:
#   device   nvidia-smi; which NVRTC, libcuda and Vulkan loader the binaries will load
#   smoke    `tern generate` on cuda and on wgpu (the bundled model; prints each device)
#   cuda     the cuda instances of the op/golden/engine/... tests, TERN_REQUIRE_CUDA=1
#   wgpu     the wgpu instances of the same tests, TERN_REQUIRE_WGPU=1
#   bench    `xtask fixtures --bench` here, then `xtask bench --backend cuda,wgpu --no-llama`
#   kernels  every kernel through this machine's NVRTC and ptxas for sm_86 and sm_90
# The summary ($OUT/summary.md) is rewritten after every step, so a run cut short still says
# how far it got. At most 8 files are written to $OUT (the device tool brings back no more).
#
# Knobs (environment):
#   TERN_KIT_BUDGET_S  overall wall-clock budget in seconds (default 500: the device tool's
#                      10-minute call with room for the machine's start and the copy back)
#   TERN_KIT_BENCH     full (default: bench-0.8b Q8_0 and PQ2_0, generated here), tiny (the
#                      committed tiny fixtures, a few tokens: a dry run), off
#   TERN_KIT_TESTS     the test binaries to run (default: all of the kit's)
#   TERN_KIT_JOBS      test binaries run at once per backend (default 4; 1 on a small box)
#   TERN_KIT_WORK      scratch directory (default /tmp/tern-gpu-kit)
#   TERN_CUDA_EMULATE=1  no GPU here: the cuda steps run on tern's CPU emulator (a dry run)
#   OUT                where the summary and logs go (default: <kit>/out)

set -u
export LC_ALL=C

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
. "$KIT/kit.env" || { echo "gpu-check: $KIT/kit.env is missing: rebuild the kit" >&2; exit 2; }

OUT="${OUT:-$KIT/out}"
mkdir -p "$OUT"
BUDGET="${TERN_KIT_BUDGET_S:-500}"
BENCH_MODE="${TERN_KIT_BENCH:-full}"
SELECTED="${TERN_KIT_TESTS:-$KIT_TESTS}"
JOBS="${TERN_KIT_JOBS:-4}"
WORK="${TERN_KIT_WORK:-/tmp/tern-gpu-kit}"
START=$(date +%s)
DEADLINE=$((START + BUDGET))

SUMMARY="$OUT/summary.md"
DEVLOG="$OUT/device.log"
ROWS="$WORK/rows.md"
NOTES="$WORK/notes.md"
FAILS="$WORK/failures.md"
BENCH_TABLE="$WORK/bench-table.txt"

rm -rf "$WORK"
mkdir -p "$WORK/bin" "$WORK/run"
: >"$ROWS"
: >"$NOTES"
: >"$FAILS"
: >"$BENCH_TABLE"
: >"$DEVLOG"

now() { date +%s; }
note() { echo "- $*" >>"$NOTES"; echo "[kit] $*" >&2; }
# row STEP RESULT PASSED FAILED IGNORED SECONDS
row() { echo "| $1 | $2 | $3 | $4 | $5 | $6 s |" >>"$ROWS"; }

write_summary() {
  {
    echo "# tern GPU check"
    echo
    echo "Kit built $KIT_BUILT_UTC from $KIT_GIT at \`$KIT_BUILT_AT\`; run $(date -u +%Y-%m-%dT%H:%M:%SZ) in \`$ROOT\`."
    echo "Budget ${BUDGET} s, $(($(now) - START)) s used; bench: $BENCH_MODE; jobs: $JOBS; tests: $SELECTED."
    [ "${TERN_CUDA_EMULATE:-}" = 1 ] && echo "TERN_CUDA_EMULATE=1: the cuda steps ran on tern's CPU emulator, not a GPU."
    echo
    echo "## Device"
    echo
    cat "$NOTES"
    echo
    echo "## Steps"
    echo
    echo "| step | result | passed | failed | ignored | time |"
    echo "|---|---|---|---|---|---|"
    cat "$ROWS"
    if [ -s "$FAILS" ]; then
      echo
      echo "## Failures (first lines; the whole output is in the step's log)"
      echo
      cat "$FAILS"
    fi
    if [ -s "$BENCH_TABLE" ]; then
      echo
      echo "## Bench"
      echo
      echo '```'
      cat "$BENCH_TABLE"
      echo '```'
    fi
  } >"$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}
trap write_summary EXIT

# Seconds a step may take: up to CAP, ending RESERVE seconds before the deadline (what the
# later steps need at least), never below 0. Both are set for the default budget and scale with
# TERN_KIT_BUDGET_S (a dry run on the emulator is given a larger one).
step_secs() {
  local cap=$(($1 * BUDGET / 500)) reserve=$(($2 * BUDGET / 500)) left
  left=$((DEADLINE - $(now) - reserve))
  ((left < cap)) && cap=$left
  ((cap < 0)) && cap=0
  echo "$cap"
}

# capped SECS LOG CMD...: CMD with a timeout, its output appended to LOG; 125 when no time was
# left to start it, 124 when it timed out.
capped() {
  local secs=$1 log=$2
  shift 2
  if ((secs < 5)); then
    echo "[kit] not run, no time left: $*" >>"$log"
    return 125
  fi
  echo "[kit] \$ $* (timeout ${secs}s)" >>"$log"
  timeout -k 5 "$secs" "$@" >>"$log" 2>&1
}

verdict() {
  case $1 in
    0) echo ok ;;
    124 | 137) echo "TIMEOUT" ;;
    125) echo "not run (out of time)" ;;
    *) echo "FAIL (rc $1)" ;;
  esac
}

# The tree the test binaries read: they were compiled with the kit's build directory as
# CARGO_MANIFEST_DIR and read fixtures/, shaders/ and cuda/ under it. The kit lives in
# <repo>/target/gpu-kit of a copy of the same tree; where that copy sits elsewhere, the build
# path is made a link to it.
ROOT="$(cd "$KIT/../.." && pwd)"
if [ ! -f "$ROOT/Cargo.toml" ] || [ ! -d "$ROOT/fixtures" ]; then
  ROOT="$KIT_BUILT_AT"
fi
if [ "$ROOT" != "$KIT_BUILT_AT" ]; then
  if [ -L "$KIT_BUILT_AT" ] || [ ! -e "$KIT_BUILT_AT" ]; then
    if mkdir -p "$(dirname "$KIT_BUILT_AT")" && ln -sfn "$ROOT" "$KIT_BUILT_AT"; then
      note "tree: $KIT_BUILT_AT (the build path compiled into the tests) -> $ROOT"
    else
      note "tree: could not link $KIT_BUILT_AT to $ROOT: the tests will not find their fixtures"
    fi
  else
    note "tree: $KIT_BUILT_AT exists and is not $ROOT: the tests read their fixtures there"
  fi
fi
if (cd "$KIT_BUILT_AT" 2>/dev/null && sha256sum --quiet -c "$KIT/tree.sha256" >"$WORK/tree-check.txt" 2>&1); then
  note "tree: the $(wc -l <"$KIT/tree.sha256") fixture, shader and kernel files the tests read match the kit's build"
else
  note "tree: files the tests read that differ from the kit's build: $(grep -c 'FAILED' "$WORK/tree-check.txt") (first: $(head -n 1 "$WORK/tree-check.txt")): results may not be this commit's"
fi

# Unpack the binaries (xz with tar where it exists, else Python's lzma).
if ! { tar -C "$WORK/bin" -xJf "$KIT/kit.tar.xz" 2>/dev/null ||
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
    "$KIT/kit.tar.xz" "$WORK/bin"; }; then
  note "kit: cannot unpack $KIT/kit.tar.xz (neither tar -J nor python3's lzma worked)"
  exit 1
fi
BIN="$WORK/bin"

export XDG_RUNTIME_DIR="$WORK/xdg"
mkdir -p "$XDG_RUNTIME_DIR"
chmod 700 "$XDG_RUNTIME_DIR"

# ---- device: what is there, and what the binaries will load --------------------------------
t0=$(now)
# ldconfig may live in /sbin, off a plain PATH.
LDCONFIG=$(command -v ldconfig || echo /sbin/ldconfig)
has_lib() { "$LDCONFIG" -p 2>/dev/null | grep -q "[[:space:]]$1 "; }
[ -d /usr/local/nvidia/bin ] && PATH="$PATH:/usr/local/nvidia/bin"
GPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
  if capped "$(step_secs 20 400)" "$DEVLOG" nvidia-smi; then
    GPU=1
    capped 10 "$DEVLOG" nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm,clocks.max.mem --format=csv
    note "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -n 1); $(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -n 1)"
  else
    note "nvidia-smi: failed (device.log)"
  fi
else
  note "nvidia-smi: not found (no NVIDIA driver here)"
  echo "nvidia-smi: not found" >>"$DEVLOG"
fi
row "device: nvidia-smi" "$([ $GPU = 1 ] && echo ok || echo 'not found / failed')" - - - $(($(now) - t0))

# The driver's libraries (libcuda for cuda; libGLX_nvidia, which NVIDIA's Vulkan ICD names, for
# wgpu) from the container's driver folder, where the loader cache does not list them.
EXTRA_LIB=""
for l in libcuda.so.1 libGLX_nvidia.so.0; do
  if ! has_lib "$l"; then
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
      if [ -e "$d/$l" ]; then
        case ":$EXTRA_LIB:" in *":$d:"*) ;; *) EXTRA_LIB="$EXTRA_LIB:$d" ;; esac
        note "$l: $d (not in the loader cache; added to LD_LIBRARY_PATH)"
        break
      fi
    done
  fi
done

# NVRTC: tern loads libnvrtc.so.12, .so.13 or .so from the loader path, else the file named by
# TERN_NVRTC_LIB (src/backend/cuda/nvrtc_lib.rs). This machine may have it only inside a pip
# wheel (nvidia/cu13/lib/libnvrtc.so.13) or a toolkit folder off the loader path.
if [ -n "${TERN_NVRTC_LIB:-}" ]; then
  note "NVRTC: TERN_NVRTC_LIB=$TERN_NVRTC_LIB (given)"
elif has_lib libnvrtc.so.12 || has_lib libnvrtc.so.13 || has_lib libnvrtc.so; then
  note "NVRTC: on the loader path: $("$LDCONFIG" -p | grep -o 'libnvrtc\.so[.0-9]* .*=> [^ ]*' | tr '\n' ' ')"
else
  cands=$(
    python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    for p in nvidia.__path__:
        for f in sorted(glob.glob(os.path.join(p, "*", "lib", "libnvrtc.so.1[0-9]"))):
            print(f)
except Exception:
    pass
PY
    ls -d /usr/local/cuda/lib64/libnvrtc.so.1[0-9] /usr/local/cuda*/targets/x86_64-linux/lib/libnvrtc.so.1[0-9] 2>/dev/null
  )
  # The newest major first: a CUDA 13 driver runs cubins from either, and the device only has
  # what its image brought.
  pick=$(echo "$cands" | grep -v '^$' | awk -F'libnvrtc.so.' '{print $NF" "$0}' | sort -k1,1nr |
    head -n 1 | cut -d' ' -f2-)
  if [ -n "$pick" ]; then
    export TERN_NVRTC_LIB="$pick"
    note "NVRTC: not on the loader path; TERN_NVRTC_LIB=$pick (found among: $(echo "$cands" | tr '\n' ' '))"
  else
    note "NVRTC: not found (no libnvrtc.so.1x on the loader path, in pip's nvidia/*/lib or under /usr/local/cuda*)"
  fi
fi

# ptxas for the kernels step: the toolkit's, where PATH lacks it.
if [ -z "${TERN_PTXAS:-}" ] && ! command -v ptxas >/dev/null 2>&1; then
  for p in /usr/local/cuda/bin/ptxas /usr/local/cuda-*/bin/ptxas; do
    [ -x "$p" ] && export TERN_PTXAS="$p" && break
  done
fi

# Vulkan: the loader and libGLdispatch (which NVIDIA's Vulkan driver links) from the kit where
# the machine has none; the driver's ICD file from the container's driver folder where the
# loader's own folders lack one.
mkdir -p "$WORK/lib"
for l in libvulkan.so.1 libGLdispatch.so.0; do
  if ! has_lib "$l"; then
    if [ -e "$BIN/lib/$l" ]; then
      ln -sf "$BIN/lib/$l" "$WORK/lib/$l"
      note "$l: not on this machine; the kit's copy is used"
    else
      note "$l: not on this machine and not in the kit: wgpu will find no Vulkan"
    fi
  fi
done
EXTRA_LIB="${EXTRA_LIB#:}:$WORK/lib"
# After what is set already: these only fill gaps. (No empty entry: that would mean the cwd.)
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$EXTRA_LIB"
if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] &&
  ! ls /etc/vulkan/icd.d/nvidia* /usr/share/vulkan/icd.d/nvidia* /usr/local/share/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
  icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  if [ -e "$icd" ]; then
    export VK_DRIVER_FILES="$icd" VK_ICD_FILENAMES="$icd"
    note "Vulkan ICD: $icd (VK_DRIVER_FILES)"
  elif [ $GPU = 1 ]; then
    note "Vulkan ICD: no nvidia_icd.json found: wgpu may see no NVIDIA adapter"
  fi
fi
write_summary

# ---- smoke: the CLI end to end on each backend, and each device's description -------------
cd "$KIT_BUILT_AT" || exit 1
for be in cuda wgpu; do
  t0=$(now)
  log="$WORK/smoke-$be.log"
  if [ "$be" = cuda ] && [ "${TERN_CUDA_EMULATE:-}" = 1 ] && [ $GPU = 0 ]; then
    row "smoke: tern generate --backend cuda" "skipped (the CLI has no emulator)" - - - 0
    continue
  fi
  capped "$(step_secs 40 380)" "$log" "$BIN/tern" generate --backend "$be" \
    --prompt "To be, or not to be" -n 24
  rc=$?
  cat "$log" >>"$DEVLOG"
  # The backend's description line, bare or behind tracing's timestamp and level.
  line=$(grep -m 1 -oE '(cuda device|wgpu adapter) .*' "$log")
  note "$be (tern): ${line:-no device line; see device.log}"
  if [ "$be" = wgpu ] && [ $GPU = 1 ] && echo "$line" | grep -q 'Cpu,'; then
    note "wgpu picked a software adapter on a GPU machine: the NVIDIA Vulkan driver was not found"
    rc=1
  fi
  row "smoke: tern generate --backend $be" "$(verdict $rc)" - - - $(($(now) - t0))
  if [ $rc != 0 ]; then
    { echo "### smoke --backend $be ($(verdict $rc))"; echo '```'
      grep -v -E '^ *[0-9]+: |^ +at |^Stack backtrace:|^$' "$log" | tail -n 8
      echo '```'; } >>"$FAILS"
  fi
done
write_summary

# ---- tests ---------------------------------------------------------------------------------
# run_tests KIND SECS ENV...: every selected test binary filtered to KIND, JOBS at a time; a row
# per binary, and the totals in T_PASSED, T_FAILED, T_IGNORED, T_BAD (binaries that failed).
run_tests() {
  local kind=$1 secs=$2
  shift 2
  local end=$(($(now) + secs)) t
  for t in $SELECTED; do
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n; done
    (
      s=$((end - $(now)))
      t1=$(now)
      capped "$s" "$WORK/run/$kind.$t.log" env "$@" "$BIN/$t" "$kind"
      echo "$? $(($(now) - t1))" >"$WORK/run/$kind.$t.rc"
    ) &
  done
  wait
  local log="$OUT/tests-$kind.log" rc secs p f i
  T_PASSED=0 T_FAILED=0 T_IGNORED=0 T_BAD=0
  : >"$log"
  for t in $SELECTED; do
    touch "$WORK/run/$kind.$t.log"
    cat "$WORK/run/$kind.$t.log" >>"$log"
    # No status file: the binary's subshell itself was killed.
    read -r rc secs <"$WORK/run/$kind.$t.rc" 2>/dev/null || { rc=125 secs=0; }
    # libtest: "test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 9 filtered out; ..."
    local res
    res=$(grep -E '^test result:' "$WORK/run/$kind.$t.log" | tail -n 1)
    p=$(echo "$res" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+')
    f=$(echo "$res" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+')
    i=$(echo "$res" | grep -oE '[0-9]+ ignored' | grep -oE '[0-9]+')
    p=${p:-0} f=${f:-0} i=${i:-0}
    local v
    v=$(verdict "$rc")
    if [ "$rc" = 0 ] && [ "$p" = 0 ]; then
      v="FAIL (no $kind test ran)"
      rc=1
    fi
    [ "$rc" != 0 ] && T_BAD=$((T_BAD + 1))
    T_PASSED=$((T_PASSED + p)) T_FAILED=$((T_FAILED + f)) T_IGNORED=$((T_IGNORED + i))
    row "$kind: $t" "$v" "$p" "$f" "$i" "$secs"
    if [ "$rc" != 0 ]; then
      {
        echo "### $kind: $t ($v)"
        echo '```'
        { grep -E '^test .* FAILED$' "$WORK/run/$kind.$t.log"
          grep -E -A3 "panicked at" "$WORK/run/$kind.$t.log"
          tail -n 5 "$WORK/run/$kind.$t.log"; } | awk '!seen[$0]++' | head -n 40
        echo '```'
      } >>"$FAILS"
    fi
  done
}

# The wgpu step and a bench run are worth more than the last minutes of the cuda step: each
# step's cap ends early enough to leave the later ones their least useful time.
for kind in cuda wgpu; do
  t0=$(now)
  if [ $kind = cuda ]; then
    run_tests cuda "$(step_secs 260 140)" TERN_REQUIRE_CUDA=1
  else
    run_tests wgpu "$(step_secs 160 80)" TERN_REQUIRE_WGPU=1
  fi
  n=$(echo "$SELECTED" | wc -w)
  row "**$kind: all**" "$([ $T_BAD = 0 ] && echo ok || echo "FAIL ($T_BAD of $n binaries)")" \
    $T_PASSED $T_FAILED $T_IGNORED $(($(now) - t0))
  write_summary
done

# ---- bench ---------------------------------------------------------------------------------
BLOG="$OUT/bench.log"
: >"$BLOG"
bench() { # bench BACKENDS SECS ARGS...: one `xtask bench --backend BACKENDS` run; table and JSON kept
  local backends=$1 secs=$2 rc label
  shift 2
  label=$([ "$backends" = cuda,wgpu ] && echo "" || echo "-$backends")
  t0=$(now)
  capped "$secs" "$WORK/bench-run.log" "$BIN/xtask" bench --backend "$backends" "$@"
  rc=$?
  cat "$WORK/bench-run.log" >>"$BLOG"
  # The table: from its header line to the end of the run's output, less the xtask's notes.
  sed -n '/^file  *engine/,$p' "$WORK/bench-run.log" | grep -v '^wrote ' >>"$BENCH_TABLE"
  if [ $rc = 0 ] && [ -f "$KIT_BUILT_AT/target/bench/bench.json" ]; then
    cp "$KIT_BUILT_AT/target/bench/bench.json" "$OUT/bench$label.json"
  elif [ $rc != 0 ]; then
    { echo "### bench --backend $backends ($(verdict $rc))"; echo '```'
      grep -v -E '^ *[0-9]+: |^ +at |^Stack backtrace:|^$' "$WORK/bench-run.log" | tail -n 8
      echo '```'; } >>"$FAILS"
  fi
  : >"$WORK/bench-run.log"
  row "bench: --backend $backends" "$(verdict $rc)" - - - $(($(now) - t0))
  return $rc
}
case "$BENCH_MODE" in
  full)
    t0=$(now)
    mkdir -p "$WORK/bench-fixtures"
    capped "$(step_secs 120 60)" "$BLOG" "$BIN/xtask" fixtures --bench --out "$WORK/bench-fixtures"
    rc=$?
    row "bench: xtask fixtures --bench (bench-0.8b Q8_0, PQ2_0)" "$(verdict $rc)" - - - $(($(now) - t0))
    if [ $rc != 0 ]; then
      { echo "### xtask fixtures --bench ($(verdict $rc))"; echo '```'; tail -n 8 "$BLOG"; echo '```'; } >>"$FAILS"
    fi
    FILES="$WORK/bench-fixtures/bench/bench-0.8b-q8_0.gguf $WORK/bench-fixtures/bench/bench-0.8b-pq2_0.gguf"
    ARGS="--no-llama"
    ;;
  tiny)
    rc=0
    FILES="$KIT_BUILT_AT/fixtures/tiny-q8_0.gguf $KIT_BUILT_AT/fixtures/tiny-pq2_0.gguf"
    ARGS="--no-llama --prompt 16 --decode 8 --runs 1"
    ;;
  *)
    rc=off
    row "bench" "skipped (TERN_KIT_BENCH=$BENCH_MODE)" - - - 0
    ;;
esac
if [ "$rc" = 0 ] && [ "${TERN_CUDA_EMULATE:-}" = 1 ] && [ $GPU = 0 ]; then
  # A dry run: the bench has no emulator, so only wgpu is measured.
  row "bench: --backend cuda" "skipped (the bench has no emulator)" - - - 0
  # shellcheck disable=SC2086
  bench wgpu "$(step_secs 200 15)" $ARGS $FILES
elif [ "$rc" = 0 ]; then
  # shellcheck disable=SC2086
  if ! bench cuda,wgpu "$(step_secs 200 15)" $ARGS $FILES; then
    # One backend failing stops the combined run: measure each alone.
    for be in cuda wgpu; do
      # shellcheck disable=SC2086
      bench $be "$(step_secs 100 10)" $ARGS $FILES
    done
  fi
fi
rm -rf "$WORK/bench-fixtures"
write_summary

# ---- kernels: this machine's NVRTC and ptxas on every module for sm_86 and sm_90 -----------
if [ -n "${KIT_KERNELS_TEST:-}" ] && [ -x "$BIN/$KIT_KERNELS_TEST" ]; then
  t0=$(now)
  klog="$OUT/kernels.log"
  : >"$klog"
  cap=$(step_secs 90 0)
  capped "$cap" "$klog" env TERN_REQUIRE_NVRTC=1 "$BIN/$KIT_KERNELS_TEST" --nocapture
  rc=$?
  res=$(grep -E '^test result:' "$klog" | tail -n 1)
  p=$(echo "$res" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+')
  f=$(echo "$res" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+')
  nv=$(grep -m 1 -oE '^NVRTC [0-9.]+' "$klog")
  row "kernels: ${nv:-NVRTC} + ptxas, sm_86 and sm_90" "$(verdict $rc)" "${p:-0}" "${f:-0}" 0 $(($(now) - t0))
  if [ $rc != 0 ]; then
    { echo "### kernels ($(verdict $rc))"; echo '```'
      # A timeout leaves no verdicts: its cap and the last kernels it reached say how far it got.
      if [ $rc = 124 ] || [ $rc = 137 ]; then echo "[kit] stopped at its ${cap} s cap; its last lines:"; fi
      { grep -E '^test .* FAILED$' "$klog"; grep -E -A5 "panicked at" "$klog"
        tail -n 5 "$klog"; } | awk '!seen[$0]++' | head -n 40
      echo '```'; } >>"$FAILS"
  fi
fi

echo "[kit] done in $(($(now) - START)) s; summary: $SUMMARY" >&2
write_summary
cat "$SUMMARY"
