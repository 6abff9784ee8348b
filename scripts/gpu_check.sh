#!/usr/bin/env bash
# Runs the GPU-marked tests on a CUDA machine without network, and prints one summary line per stage.
# Installs kiln (not editable; no dependencies: the machine's torch, transformers, ... are used) and runs pytest from
# outside the repository root, where the top-level kiln/ folder would shadow the installed package.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-/tmp/kiln-gpu-check}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation "$repo" 2>&1 | tail -n 3
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "SUMMARY install: FAILED"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
cd "$repo/tests"
# Only the files that hold gpu tests: collecting the others would import client packages (tritonclient, openai)
# that a GPU image need not have.
files=$(grep -l -E "mark\.gpu" test_*.py)
python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" $files 2>&1 | tee "$out/gpu_tests.log"
status=${PIPESTATUS[0]}
echo "SUMMARY gpu tests: $(tail -n 1 "$out/gpu_tests.log") (exit $status)"
exit "$status"
