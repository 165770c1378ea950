#!/usr/bin/env bash
# One command for a GPU machine: build gaengine (with its CUDA kernels), run the CUDA tests, then
# `gaengine bench --device cuda` and the per-kernel scripts, writing benchmarks/results/<device-slug>*.json.
#
#   bash benchmarks/run_gpu.sh            # from anywhere; torch (a CUDA build) must already be installed
#
# Environment: PYTHON (default python3); SKIP_BUILD=1 to reuse an existing build; SKIP_TESTS=1 to skip
# `pytest -m cuda` (needs pytest and hypothesis installed). Then commit benchmarks/results/<device-slug>*
# (see benchmarks/README.md).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"

"$PYTHON" - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"run_gpu.sh: no CUDA device visible to torch {torch.__version__} "
             f"(torch.version.cuda={torch.version.cuda})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
    # The extension must build here: it carries the `cuda` backend's kernels.
    GAENGINE_BUILD_EXT=1 "$PYTHON" -m pip install --disable-pip-version-check -q --no-build-isolation -e .
fi

slug="$("$PYTHON" -c 'import re, torch
print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')"
out="benchmarks/results"
mkdir -p "$out"
echo "device slug: $slug"

if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    "$PYTHON" -m pytest -m cuda -q
fi

"$PYTHON" -m gaengine bench --device cuda --json "$out/$slug.json" --plot "$out/$slug.png"
"$PYTHON" benchmarks/bench_accumulate.py --device cuda --json "$out/$slug-accumulate.json"
"$PYTHON" benchmarks/bench_step.py --device cuda --json "$out/$slug-step.json"

echo
echo "results: $(ls "$out/$slug"*)"
echo "commit them: git add $out/$slug*.json $out/$slug.png && git commit -m \"Benchmark results: $slug\""
