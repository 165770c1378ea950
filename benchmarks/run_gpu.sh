#!/usr/bin/env bash
# One command for a GPU machine: build gaengine (with its CUDA kernels), run the WHOLE test suite, then
# `gaengine bench --device cuda` (kernels, host overhead per parameter, e2e), the per-kernel scripts and, when
# present, .gpu/profile_e2e.py; results in benchmarks/results/<device-slug>*.json, every step's log in LOG_DIR.
#
#   bash benchmarks/run_gpu.sh            # from anywhere; torch (a CUDA build) must already be installed
#
# Environment: PYTHON (default python3); SKIP_BUILD=1 to reuse an existing build; SKIP_TESTS=1 to skip the
# tests (they need pytest and hypothesis; with pytest-xdist and pytest-timeout installed they run as
# `pytest -q -n 8 --timeout 150`, else `pytest -q`); LOG_DIR (default out/gpu-logs, git-ignored). A failing
# step does not stop the ones after it: the script ends with a summary and exits 1 if any step failed. Then
# commit benchmarks/results/<device-slug>* (see benchmarks/README.md).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

"$PYTHON" - <<'EOF' || exit 1
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"run_gpu.sh: no CUDA device visible to torch {torch.__version__} "
             f"(torch.version.cuda={torch.version.cuda})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

slug="$("$PYTHON" -c 'import re, torch
print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')"
out="benchmarks/results"
logs="${LOG_DIR:-out/gpu-logs}"
mkdir -p "$out" "$logs"
echo "device slug: $slug; logs in $logs/"

failed=()
# step NAME CMD...: run CMD, its stdout and stderr to the terminal and to $logs/NAME.log; remember a failure.
step() {
    local name="$1"
    shift
    echo
    echo "=== $name: $* ($(date -u +%H:%M:%S) UTC)"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$logs/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$logs/$name.log"
    if [[ $rc -ne 0 ]]; then
        failed+=("$name (exit $rc)")
    fi
    return 0
}

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
    # The extension must build here: it carries the `cuda` backend's kernels. --no-deps: nothing is installed
    # from a registry (a GPU machine may have no network).
    step build env MAX_JOBS="${MAX_JOBS:-$(nproc)}" GAENGINE_BUILD_EXT=1 \
        "$PYTHON" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
    if [[ ${#failed[@]} -ne 0 ]]; then
        echo "run_gpu.sh: the build failed (see $logs/build.log)" >&2
        exit 1
    fi
fi

if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    # The whole suite (CPU and CUDA tests): -n isolates a crashing test in its own worker.
    if "$PYTHON" -c 'import xdist, pytest_timeout' 2>/dev/null; then
        step tests "$PYTHON" -m pytest -q -n 8 --timeout 150
    else
        step tests "$PYTHON" -m pytest -q
    fi
fi

step bench "$PYTHON" -m gaengine bench --device cuda --json "$out/$slug.json" --plot "$out/$slug.png"
step bench_accumulate "$PYTHON" benchmarks/bench_accumulate.py --device cuda --json "$out/$slug-accumulate.json"
step bench_step "$PYTHON" benchmarks/bench_step.py --device cuda --json "$out/$slug-step.json"
# Gradient accumulation fusion (docs/fusion.md): the same short bf16 GPT run with and without it, each against the
# plain recipe (--compare); the summaries give tokens/s and peak memory, so the first GPU run says whether it
# becomes the default.
for fusion in no-gradient-accumulation-fusion gradient-accumulation-fusion; do
    step "train-$fusion" "$PYTHON" -m gaengine train --device cuda --steps 50 --compare --quiet "--$fusion" \
        --out "$logs/train-$fusion"
done
if [[ -f .gpu/profile_e2e.py ]]; then
    # A copy of ../shared/tools/profile_e2e.py (../shared is not on a GPU machine): host vs GPU time per update.
    step profile_e2e "$PYTHON" .gpu/profile_e2e.py
fi

echo
echo "results: $(ls "$out/$slug"* 2>/dev/null)"
echo "logs: $(ls "$logs"/*.log)"
if [[ ${#failed[@]} -ne 0 ]]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "commit them: git add $out/$slug*.json $out/$slug.png && git commit -m \"Benchmark results: $slug\""
