#!/usr/bin/env bash
# The GPU check: installs kiln on a CUDA machine without network, runs the gpu-marked tests, builds the
# Llama-3.1-8B-shaped dummy-weight engine and runs `kiln bench latency` and `kiln bench throughput` on it,
# then prints one summary (the lines starting with SUMMARY). Results land in $OUT (default /tmp/kiln-gpu-check).
#
#   bash scripts/gpu_check.sh             # tests + latency 128/256 + throughput 128/128 x 3000
#   KILN_BENCH_FULL=1 bash scripts/gpu_check.sh   # also throughput 128/2048, 2048/128, TTFT at 2048 input
#   KILN_SKIP_TESTS=1 / KILN_SKIP_BENCH=1         # one half only
#   KILN_BENCH_QFORMAT=fp8|int4_awq|int8_sq|int8_wo|int4_wo KILN_BENCH_KV=fp8|int8   # a quantized dummy engine
#   KILN_BENCH_MAX_BATCH=256                      # the engine's max_batch_size (default 1024)
#   KILN_NO_KERNELS=1                             # build without stored kernels (--no-kernels): Triton compiles at start
#
# Before the benchmarks it starts the engine once with an empty Triton cache (a first start on a new machine) and
# prints the startup log's stage times and how many kernels Triton still compiled (SUMMARY startup-first).
#
# Installs kiln (not editable; no dependencies: the machine's torch, triton, transformers are used) and runs
# pytest from tests/, where the top-level kiln/ folder of the checkout would not shadow the installed package.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-/tmp/kiln-gpu-check}"
qformat="${KILN_BENCH_QFORMAT:-}"
kv_dtype="${KILN_BENCH_KV:-}"
no_kernels="${KILN_NO_KERNELS:-0}"
suffix="${qformat:+-$qformat}${kv_dtype:+-kv$kv_dtype}"
[ "$no_kernels" = 1 ] && suffix+="-nokernels"
max_batch="${KILN_BENCH_MAX_BATCH:-1024}"
engine="${KILN_BENCH_ENGINE:-/tmp/kiln-llama-3.1-8b-dummy$suffix-b$max_batch}"
quant_flags=()
[ -n "$qformat" ] && quant_flags+=(--qformat "$qformat")
[ -n "$kv_dtype" ] && quant_flags+=(--kv-cache-dtype "$kv_dtype")
[ "$no_kernels" = 1 ] && quant_flags+=(--no-kernels)
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation "$repo" 2>&1 | tail -n 3
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "SUMMARY install: FAILED"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
summary=()

if [ "${KILN_SKIP_TESTS:-0}" != 1 ]; then
  cd "$repo/tests"
  # Only the files that hold gpu tests: collecting the others would import client packages (tritonclient, openai)
  # that a GPU image need not have.
  files=$(grep -l -E "mark\.gpu" test_*.py)
  python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" $files 2>&1 \
    | tee "$out/gpu_tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  summary+=("SUMMARY gpu tests: $(tail -n 1 "$out/gpu_tests.log") (exit $rc)")
  cd "$repo"
fi

bench() {  # bench NAME ARGS...: one `kiln bench` run, its table in $out/NAME.txt and JSON in $out/NAME.json
  local name=$1; shift
  echo "== kiln bench $*"
  kiln bench "$@" --engine "$engine" --output "$out/$name.json" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  summary+=("SUMMARY $name: $(python3 - "$out/$name.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("FAILED"); sys.exit()
if r["benchmark"] == "latency":
    print(f"TTFT {r['ttft_ms']:.1f} ms, decode {r['decode_tokens_per_s']:.1f} tok/s, ITL p50/p99 "
          f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} ms, startup {r['startup_s']:.1f} s, graphs {r['graph_capture_s']:.1f} s")
else:
    print(f"{r['output_tokens_per_s']:.0f} output tok/s, {r['total_tokens_per_s']:.0f} total tok/s "
          f"({r['spec']['num_requests']} requests in {r['elapsed_s']:.1f} s), startup {r['startup_s']:.1f} s")
EOF
)")
}

startup() {  # startup NAME: the engine's first start with an empty Triton cache; the stage times of its log
  local name=$1 cache
  cache=$(mktemp -d)
  echo "== first start (empty Triton cache): kiln bench latency --input-len 128 --output-len 8 --num-iters 1"
  TRITON_CACHE_DIR="$cache" kiln --log-level INFO bench latency --engine "$engine" --input-len 128 --output-len 8 \
    --num-iters 1 --output "$out/$name.json" >"$out/$name.txt" 2>&1 || status=1
  grep -E "ready in|kernels of engine|captured CUDA graphs" "$out/$name.txt"
  # Stored kernels are installed without their IRs: a .ptx file in the cache is a kernel Triton compiled here.
  summary+=("SUMMARY $name: $(grep -o 'ready in .*' "$out/$name.txt" | tail -n 1); Triton compiled" \
            "$(find "$cache" -name '*.ptx' | wc -l) kernels")
  rm -rf "$cache"
}

if [ "${KILN_SKIP_BENCH:-0}" != 1 ]; then
  if [ ! -f "$engine/engine.json" ]; then
    start=$(date +%s)
    kiln build --checkpoint "$repo/benchmarks/configs/llama-3.1-8b" --output "$engine" --dummy-weights \
      --dtype bfloat16 --device cuda --max-batch-size "$max_batch" --max-num-tokens 8192 --max-seq-len 4224 "${quant_flags[@]}" \
      || { echo "SUMMARY build: FAILED"; exit 1; }
    summary+=("SUMMARY build: llama-3.1-8b dummy engine$suffix in $(( $(date +%s) - start )) s")
  fi
  startup startup-first$suffix
  bench latency-128-256$suffix latency --input-len 128 --output-len 256
  bench throughput-128-128$suffix throughput --input-len 128 --output-len 128 --num-requests 3000
  if [ "${KILN_BENCH_FULL:-0}" = 1 ]; then
    bench latency-2048-16$suffix latency --input-len 2048 --output-len 16
    bench throughput-128-2048$suffix throughput --input-len 128 --output-len 2048 --num-requests 1000
    bench throughput-2048-128$suffix throughput --input-len 2048 --output-len 128 --num-requests 1000
  fi
fi

printf '%s\n' "${summary[@]}"
exit "$status"
