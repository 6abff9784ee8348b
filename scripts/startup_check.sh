#!/usr/bin/env bash
# The startup check (issue 33, item 2: ready within 5 s on a fresh machine): builds the Llama-3.1-8B-shaped
# dummy-weight engines (BF16, and FP8 with an FP8 KV cache; the same directories as scripts/gpu_check.sh, so
# engines it built are reused), then starts each in a fresh process twice and prints the startup log:
#   first start:  no verification stamps (an empty KILN_CACHE_DIR: every file is hashed) and an empty Triton
#                 cache (the engine's stored kernels are installed), page cache dropped when this may;
#   second start: the same caches, now holding the stamps and kernels, as a restart on that machine.
# Then, per engine, a micro-benchmark of its weight file: one-thread sha256 (the floor of a first start: the
# largest file is hashed by one thread), safetensors' load_file and kiln's reader with 1-8 threads.
# Results land in $OUT (default /tmp/kiln-startup-check); the lines starting with SUMMARY come last.
#
#   bash scripts/startup_check.sh                         # on a GPU machine: both engines
#   KILN_STARTUP_FORMATS="bf16" bash scripts/startup_check.sh       # one of them (bf16, fp8)
#   KILN_SKIP_INSTALL=1                                   # use the kiln already installed (e.g. the venv's)
#   KILN_SKIP_MICRO=1                                     # no micro-benchmark
#   KILN_DROP_CACHES=0                                    # never drop the page cache (every read is then hot)
# A dry run on the CPU with the bundled tiny model (checks the flags and the plumbing, times nothing useful):
#   KILN_DROP_CACHES=0 KILN_SKIP_INSTALL=1 KILN_STARTUP_DEVICE=cpu KILN_STARTUP_CHECKPOINT=examples/kiln-tiny-code \
#   KILN_STARTUP_LIMITS="--max-batch-size 8 --max-num-tokens 256 --max-seq-len 256" \
#   KILN_STARTUP_ENGINE_PREFIX=/tmp/kiln-startup-dry KILN_STARTUP_FORMATS=bf16 bash scripts/startup_check.sh
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-/tmp/kiln-startup-check}"
device="${KILN_STARTUP_DEVICE:-cuda}"
checkpoint="${KILN_STARTUP_CHECKPOINT:-$repo/benchmarks/configs/llama-3.1-8b}"
max_batch="${KILN_BENCH_MAX_BATCH:-1024}"
limits="${KILN_STARTUP_LIMITS:---max-batch-size $max_batch --max-num-tokens 8192 --max-seq-len 4224}"
prefix="${KILN_STARTUP_ENGINE_PREFIX:-/tmp/kiln-llama-3.1-8b-dummy}"
formats="${KILN_STARTUP_FORMATS:-bf16 fp8}"
drop="${KILN_DROP_CACHES:-1}"  # 0: never drop the page cache (a shared machine, a dry run)
mkdir -p "$out"
status=0
summary=()

if [ "${KILN_SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation "$repo" 2>&1 | tail -n 3
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "SUMMARY install: FAILED"; exit 1; }
fi
python3 -c "import torch, safetensors; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'safetensors', safetensors.__version__, 'cpus', __import__('os').cpu_count())"
[ "$device" = cuda ] && { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; }
df -h /tmp | tail -n 1

drop_caches() {  # the page cache, so the next read comes from disk as on a fresh machine (needs root, a writable /proc)
  [ "$drop" = 1 ] || { echo "not dropped (KILN_DROP_CACHES=0: hot)"; return; }
  sync
  if (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then echo "dropped"; else echo "not dropped (hot)"; fi
}

start_once() {  # start_once NAME ENGINE: LLM(ENGINE) in a fresh process, under this shell's KILN_CACHE_DIR/TRITON_CACHE_DIR
  local name=$1 engine=$2 cache
  cache=$(drop_caches)
  python3 - "$engine" "$device" >"$out/$name.txt" 2>&1 <<'EOF'
import logging, sys, time
begin = time.perf_counter()
import torch  # noqa: F401  (imports are part of a start, timed apart)
from kiln.runtime import LLM
imported = time.perf_counter() - begin
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
start = time.perf_counter()
llm = LLM(sys.argv[1], device=sys.argv[2])
print(f"RESULT LLM() {time.perf_counter() - start:.2f} s, imports {imported:.2f} s", flush=True)
EOF
  local rc=$?
  [ "$rc" -eq 0 ] || status=1
  echo "== $name (page cache $cache)"
  grep -E "verified .* engine file|ready in|RESULT|Error" "$out/$name.txt"
  summary+=("SUMMARY $name: $(grep -o 'RESULT.*' "$out/$name.txt" | tail -n 1) (page cache $cache; exit $rc)")
  summary+=("SUMMARY $name stages: $(grep -o 'ready in .*' "$out/$name.txt" | tail -n 1)")
}

micro() {  # micro NAME ENGINE: how fast its rank0.safetensors hashes and loads, each read after dropping caches if possible
  local name=$1 engine=$2
  python3 - "$engine/rank0.safetensors" "$device" 2>&1 <<'EOF' | tee "$out/$name.txt"
import os, subprocess, sys, time
from pathlib import Path
import torch
from safetensors.torch import load_file
from kiln.engine_format.verify import file_sha256
from kiln.runtime.worker.weight_reader import read_weights
path, device = Path(sys.argv[1]), torch.device(sys.argv[2])
size = path.stat().st_size
def drop():
    if os.environ.get("KILN_DROP_CACHES", "1") == "0":
        return "hot"
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return "cold"
    except OSError:
        return "hot"
def timed(name, fn):
    cache = drop()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"MICRO {name}: {seconds:.2f} s, {size / seconds / 1e9:.2f} GB/s ({size / 1e9:.2f} GB, {cache})", flush=True)
    del result
    if device.type == "cuda":
        torch.cuda.empty_cache()
timed("sha256, one thread", lambda: file_sha256(path))
timed("safetensors load_file" + (" (lazy on the CPU)" if device.type == "cpu" else ""),
      lambda: load_file(str(path), device=str(device)))
for threads in (1, 2, 4, 8):
    timed(f"kiln read_weights, {threads} thread(s)", lambda: read_weights(path, device, threads=threads))
EOF
  summary+=("SUMMARY $name: $(grep -o 'MICRO.*' "$out/$name.txt" | sed 's/^MICRO //' | paste -sd ';' -)")
}

for format in $formats; do
  case "$format" in
    bf16) suffix=""; flags=() ;;
    fp8) suffix="-fp8-kvfp8"; flags=(--qformat fp8 --kv-cache-dtype fp8) ;;
    *) echo "unknown format $format in KILN_STARTUP_FORMATS: use bf16 and/or fp8"; exit 2 ;;
  esac
  engine="$prefix$suffix-b$max_batch"
  if [ ! -f "$engine/engine.json" ]; then
    echo "== building $engine"
    begin=$(date +%s)
    # shellcheck disable=SC2086  # $limits is a list of flags
    kiln build --checkpoint "$checkpoint" --output "$engine" --dummy-weights --dtype bfloat16 --device "$device" \
      $limits "${flags[@]}" || { echo "SUMMARY build $format: FAILED"; status=1; continue; }
    summary+=("SUMMARY build $format: $engine in $(( $(date +%s) - begin )) s")
  fi
  du -sh "$engine"
  KILN_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  export KILN_CACHE_DIR TRITON_CACHE_DIR
  start_once "startup-first-$format" "$engine"
  start_once "startup-second-$format" "$engine"
  rm -rf "$KILN_CACHE_DIR" "$TRITON_CACHE_DIR"
  unset KILN_CACHE_DIR TRITON_CACHE_DIR
  [ "${KILN_SKIP_MICRO:-0}" = 1 ] || micro "micro-$format" "$engine"
done

printf '%s\n' "${summary[@]}"
exit "$status"
