#!/usr/bin/env bash
# One command for a GPU machine: build gaengine (with its CUDA kernels), run the WHOLE test suite, then every
# benchmark step on CUDA, each step on its own (a failing step does not stop the ones after it), then one results
# file for the device, benchmarks/results/<device-slug>.json (every step's JSON, exit status and seconds), and a
# summary table, benchmarks/results/<device-slug>-summary.md, in which every figure over the bound its own run
# measured is listed as an invalid measurement (benchmarks/check_results.py). It commits nothing.
#
#   bash benchmarks/run_gpu.sh            # from anywhere; torch (a CUDA build) must already be installed
#   DRY_RUN=1 bash benchmarks/run_gpu.sh  # every Python step on the CPU at tiny sizes (CI: tests/test_run_gpu.py)
#
# Steps: bench-kernels, bench-host, bench-fusion, bench-e2e, bench-memory (ZeRO and FSDP2 on gloo CPU ranks),
# bench-accumulate, bench-step (the update: acc.step() against the recipe, and each of its passes alone),
# e2e-defaults (gaengine, the plain bf16 recipe and torch's grad_dtype=fp32, with and without
# gradient_accumulation_fusion), train-fusion-off / train-fusion-on (`gaengine train --compare`), profile-e2e
# (benchmarks/profile_e2e.py: host vs device time of one update).
#
# Environment: PYTHON (default python3); SKIP_BUILD=1 to reuse an existing build; SKIP_TESTS=1 to skip the tests
# (they need pytest and hypothesis; with pytest-xdist and pytest-timeout installed they run as
# `pytest -q -n 8 --timeout 150`, else `pytest -q`); LOG_DIR (default out/gpu-logs, git-ignored); RESULTS_DIR
# (default benchmarks/results); ONLY="step ..." runs only those steps; DRY_RUN=1: device cpu, tiny sizes, the
# build and the tests skipped unless SKIP_BUILD=0 / SKIP_TESTS=0, results in out/gpu-dry-run unless RESULTS_DIR
# says otherwise. Exit status 1 if any step failed or any figure is invalid; the summary says which.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
DRY_RUN="${DRY_RUN:-0}"

if [[ "$DRY_RUN" == "1" ]]; then
    device=cpu
    SKIP_BUILD="${SKIP_BUILD:-1}"
    SKIP_TESTS="${SKIP_TESTS:-1}"
    out="${RESULTS_DIR:-out/gpu-dry-run}"
    slug="dry-run-cpu"
    echo "run_gpu.sh: DRY_RUN=1: every step on the CPU at tiny sizes, results in $out"
else
    device=cuda
    "$PYTHON" - <<'EOF' || exit 1
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"run_gpu.sh: no CUDA device visible to torch {torch.__version__} "
             f"(torch.version.cuda={torch.version.cuda}); DRY_RUN=1 runs every step on the CPU")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF
    out="${RESULTS_DIR:-benchmarks/results}"
    slug="$("$PYTHON" -c 'import re, torch
print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')"
fi
logs="${LOG_DIR:-out/gpu-logs}"
mkdir -p "$out" "$logs"
steps_tsv="$logs/steps.tsv"
: > "$steps_tsv"
echo "device slug: $slug; logs in $logs/"

failed=()
# step NAME JSON CMD...: run CMD (unless ONLY leaves NAME out), its stdout and stderr to the terminal and to
# $logs/NAME.log; record NAME, its exit status, its seconds and the JSON it was to write in $steps_tsv.
step() {
    local name="$1" json="$2"
    shift 2
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then
        return 0
    fi
    echo
    echo "=== $name: $* ($(date -u +%H:%M:%S) UTC)"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$logs/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$logs/$name.log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$json" >> "$steps_tsv"
    if [[ $rc -ne 0 ]]; then
        failed+=("$name (exit $rc)")
    fi
    return 0
}

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
    # The extension must build here: it carries the `cuda` backend's kernels. --no-deps: nothing is installed
    # from a registry (a GPU machine may have no network).
    step build "" env MAX_JOBS="${MAX_JOBS:-$(nproc)}" GAENGINE_BUILD_EXT=1 \
        "$PYTHON" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
    if [[ ${#failed[@]} -ne 0 ]]; then
        echo "run_gpu.sh: the build failed (see $logs/build.log)" >&2
        exit 1
    fi
fi

if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    # The whole suite (CPU and CUDA tests): -n isolates a crashing test in its own worker.
    if "$PYTHON" -c 'import xdist, pytest_timeout' 2>/dev/null; then
        step tests "" "$PYTHON" -m pytest -q -n 8 --timeout 150
    else
        step tests "" "$PYTHON" -m pytest -q
    fi
fi

# Sizes: the real ones on a GPU; on a dry run the smallest that still run every code path.
if [[ "$DRY_RUN" == "1" ]]; then
    kernels=(--quick --numel 65536 --repeats 2)
    host=(--quick --host-params 4 8 --repeats 2)
    fusion=(--quick --repeats 2)
    e2e=(--n-layers 1 --d-model 32 --n-heads 2 --seq-len 16 --micro-batch-size 2 --accumulation-steps 2
         --warmup-updates 1 --timed-updates 1)
    memory=(--quick)
    accumulate=(--numel 65536 --warmup 1 --repeats 2)
    update=(--numel 65536 --params 3 --warmup 1 --repeats 2)
    defaults=(--tiny)
    train=(--steps 2 --n-layers 1 --d-model 32 --n-heads 2 --seq-len 16 --micro-batch-size 2
           --accumulation-steps 2 --eval-interval 0 --threads 1)
    profile=(--tiny --rounds 1)
else
    kernels=() host=() fusion=() e2e=() memory=() accumulate=() update=() defaults=() profile=()
    train=(--steps 50)
fi
bench=("$PYTHON" -m gaengine bench --device "$device")
j="$logs/json"
mkdir -p "$j"
step bench-kernels "$j/kernels.json" "${bench[@]}" --only accumulate l2norm scale "${kernels[@]}" --json "$j/kernels.json"
step bench-host "$j/host.json" "${bench[@]}" --only host "${host[@]}" --json "$j/host.json"
step bench-fusion "$j/fusion.json" "${bench[@]}" --only fusion "${fusion[@]}" --json "$j/fusion.json"
# The e2e rows of `gaengine bench` (the same bench_e2e and configuration; its script takes the dry run's sizes).
step bench-e2e "$j/e2e.json" "$PYTHON" benchmarks/bench_e2e.py --device "$device" "${e2e[@]}" --json "$j/e2e.json"
step bench-memory "$j/memory.json" "${bench[@]}" --only memory "${memory[@]}" --json "$j/memory.json"
step bench-accumulate "$j/accumulate.json" "$PYTHON" benchmarks/bench_accumulate.py --device "$device" \
    "${accumulate[@]}" --json "$j/accumulate.json"
step bench-step "$j/step.json" "$PYTHON" benchmarks/bench_step.py --device "$device" "${update[@]}" \
    --json "$j/step.json"
step e2e-defaults "$j/e2e-defaults.json" "$PYTHON" benchmarks/e2e_defaults.py --device "$device" \
    "${defaults[@]}" --json "$j/e2e-defaults.json"
# Gradient accumulation fusion (docs/fusion.md): the same short bf16 GPT run with and without it, each against the
# plain recipe (--compare); the summaries give tokens/s and peak memory.
for fusion_flag in no-gradient-accumulation-fusion gradient-accumulation-fusion; do
    name="train-fusion-$([[ $fusion_flag == no-* ]] && echo off || echo on)"
    step "$name" "" "$PYTHON" -m gaengine train --device "$device" --compare --quiet "--$fusion_flag" \
        "${train[@]}" --out "$logs/$name"
done
step profile-e2e "$j/profile-e2e.json" "$PYTHON" benchmarks/profile_e2e.py --device "$device" "${profile[@]}" \
    --json "$j/profile-e2e.json"

echo
# One results file for the device and the summary table (every step, its exit status, its rows, its invalid
# figures); exit 1 when a figure is invalid.
"$PYTHON" benchmarks/gpu_summary.py --steps "$steps_tsv" --slug "$slug" --device "$device" \
    --json "$out/$slug.json" --summary "$out/$slug-summary.md"
summary_rc=$?
echo "logs: $logs/"
if [[ ${#failed[@]} -ne 0 || $summary_rc -ne 0 ]]; then
    [[ ${#failed[@]} -ne 0 ]] && echo "FAILED steps: ${failed[*]}"
    [[ $summary_rc -ne 0 ]] && echo "the summary found invalid figures or could not be written (exit $summary_rc)"
    exit 1
fi
if [[ "$DRY_RUN" != "1" ]]; then
    echo "to keep them: git add $out/$slug.json $out/$slug-summary.md && git commit -m \"Benchmark results: $slug\""
fi
