#!/usr/bin/env bash
# The torch range gaengine claims (setup.py's TORCH_SPEC: torch>=2.9,<2.15), checked on a machine without a GPU.
#
#   bash .ci/torch_range.sh headers [VERSION ...]   # csrc/*.cpp compiled (g++ -fsyntax-only) against the headers
#                                                   # of each VERSION's torch (default 2.9.1 and 2.14.1, the oldest
#                                                   # and the newest supported: `make torch-headers`, in CI)
#   bash .ci/torch_range.sh smoke VERSION           # torch VERSION installed in a scratch virtualenv, the extension
#                                                   # built against it there and the smoke subset run
#                                                   # (`make torch-newest`: 2.14.1; `make torch-oldest`: 2.9.1; by
#                                                   # hand, docs/install.md)
#   bash .ci/torch_range.sh full                    # headers of 2.9.1 and 2.14.1, then smoke 2.14.1 and 2.9.1
#                                                   # (`make torch-range`)
#   bash .ci/torch_range.sh ci                      # 2.14.1 and 2.9.1 each installed and built against, then the
#                                                   # CI subset run against both at once (`make torch-ci`); .ci/run
#                                                   # runs its two halves, `ci-build` (niced, on one core, beside
#                                                   # `make test`) and `ci-test` (after it)
#
# The smoke subset (SMOKE_TESTS below, the one list): the hot path, the ops, ZeRO and FSDP2 basics, the bench's quick
# rows and their plausibility checks, the range checks themselves. The CI subset (SMOKE_CI_TESTS) is a cut of it that
# fits beside the suite in CI's time: the same files but tests/ops (whose ops test_op_table.py runs on every backend),
# 2 ranks only, without the torchrun scripts and without the emulated CUDA build (about 4 CPU minutes a version).
#
# Headers: only torch 2.13 has a CPU wheel on the development machine; on x86_64 any other version is a CUDA wheel
# (900 MB for 2.9.1, Python 3.11). The headers come from the version's Linux aarch64 wheel instead (2.9.1: a CPU
# build, 104 MB; 2.14.1: 433 MB, 24 s to download here; TORCH_HEADERS_PLATFORM to change it), downloaded once with `pip download --no-deps`, its torch/include (60 MB)
# extracted into $TORCH_HEADERS_CACHE (default ~/.cache/gaengine/torch-headers/VERSION) and the wheel deleted; later
# runs compile at once. The compile is the real build's (setup.py's flags, torch's extension defines, Python's
# headers), without code generation.
#
# Smoke: the x86_64 wheel of a torch other than 2.13 is a CUDA build; pip installs it with its nvidia-* wheels (2.14.1:
# from this machine's disk, 5.6 GB of virtualenv; 2.9.1: downloaded, docs/install.md has the sizes and times). No GPU
# is needed: the extension is built with the CPU ops alone (GAENGINE_BUILD_CUDA=0) and the tests run on the CPU. The
# virtualenv is kept in $SCRATCH and reused while it holds the same requirements.
#
# Environment: PYTHON (default python3), TORCH_HEADERS_CACHE, SCRATCH (the smoke mode's virtualenvs and build copies,
# default /tmp/gaengine-torch-range), JOBS (parallel compiles and pytest workers, default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
cache="${TORCH_HEADERS_CACHE:-$HOME/.cache/gaengine/torch-headers}"
jobs="${JOBS:-$(nproc)}"
# The headers are the same on every platform but for the build's configuration (ATen/Config.h, caffe2's macros.h,
# sleef.h) and the CUDA, ITT and fbgemm headers, none of which csrc/*.cpp includes: the Linux aarch64 wheel, a CPU
# build (2.9.1: 104 MB, 27 s here), carries them in a ninth of the x86_64 CUDA wheel's bytes (900 MB, 170 s).
platform="${TORCH_HEADERS_PLATFORM:-manylinux_2_28_aarch64}"
pyver="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"

# headers_of VERSION: the folder holding torch VERSION's include/ (downloaded and extracted once).
headers_of() {
    local version="$1" dir="$cache/$1"
    if [[ ! -f "$dir/torch/include/torch/extension.h" ]]; then
        local tmp
        tmp="$(mktemp -d)"
        local t0=$SECONDS
        echo "torch $version: downloading its wheel (pip download --no-deps) for the headers" >&2
        "$PYTHON" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
            --platform "$platform" --python-version "$pyver" "torch==$version" -d "$tmp" >&2
        local wheel
        wheel="$(ls "$tmp"/torch-*.whl)"
        echo "torch $version: $(du -m "$wheel" | cut -f1) MB wheel in $((SECONDS - t0)) s; extracting torch/include" >&2
        rm -rf "$dir.partial"
        mkdir -p "$dir.partial"
        "$PYTHON" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [m for m in z.namelist() if m.startswith("torch/include/")])' "$wheel" "$tmp/x"
        mv "$tmp/x/torch/include" "$dir.partial/include.tmp"
        mkdir -p "$dir.partial/torch"
        mv "$dir.partial/include.tmp" "$dir.partial/torch/include"
        rm -rf "$tmp" "$dir"
        mv "$dir.partial" "$dir"
        echo "torch $version: headers in $dir ($(du -sm "$dir" | cut -f1) MB) after $((SECONDS - t0)) s" >&2
    fi
    echo "$dir/torch/include"
}

# syntax VERSION: every csrc/*.cpp through the compiler's front end against torch VERSION's headers.
syntax() {
    local version="$1" inc
    inc="$(headers_of "$version")"
    local pyinc
    pyinc="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    local std  # the standard setup.py builds with against this torch (setup.cxx_standard)
    std="$("$PYTHON" -c 'import importlib.util, sys
spec = importlib.util.spec_from_file_location("gaengine_setup", "setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)
print(setup.cxx_standard(sys.argv[1]))' "$version")"
    local t0=$SECONDS
    printf '%s\n' csrc/*.cpp | xargs -P "$jobs" -I{} sh -c \
        'g++ -fsyntax-only -std=$4 -fopenmp -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
             -D_GLIBCXX_USE_CXX11_ABI=1 -isystem "$1" -isystem "$1/torch/csrc/api/include" -isystem "$2" "$3" \
         || { echo "FAILED: $3 against torch $0 headers" >&2; exit 255; }' "$version" "$inc" "$pyinc" {} "$std"
    echo "torch $version: csrc/*.cpp compile (-std=$std) against its headers ($((SECONDS - t0)) s)"
}

# The smoke subset: the files run against each torch of the range (smoke VERSION), on JOBS pytest workers.
SMOKE_TESTS=(
    tests/test_hot_path.py          # the native hot path (csrc/hot_path.cpp) against the Python oracle
    tests/test_op_table.py tests/ops # gaengine._C's ops against the fp64 references
    tests/test_zero.py              # ZeRO 1/2 on 2 gloo ranks against the plain recipe
    tests/test_fsdp2.py             # FSDP2 (torch's fully_shard) on 2 gloo ranks
    tests/test_plausible.py         # the bench's quick rows and their plausibility checks
    tests/test_torch_range.py       # the range itself, and no version-dependent access outside gaengine/compat.py
)

# The CI subset: what `.ci/run` builds and runs against the oldest and the newest torch on each submission, one test
# process each, under `-k "not cuda-emu and not emulated and not times_the_real_update"`: no emulated CUDA build, and
# not the one test that times memory bandwidth against a peak measured in the same run (test_plausible's
# FusedAdamW row): both versions run it at the same moment, each contending with the other's bandwidth, and one CI run
# judged the row over its bound that way; the suite runs it.
SMOKE_CI_TESTS=(
    tests/test_torch_range.py
    tests/test_hot_path.py
    tests/test_op_table.py
    tests/test_plausible.py
    "tests/test_zero.py::test_stages_match_one_process[2]"
    tests/test_zero.py::test_bytes_per_window_and_no_host_sync
    tests/test_zero.py::test_stage2_double_arrival_and_unused_match_one_process
    "tests/test_fsdp2.py::test_fsdp2_against_plain_recipe[2]"
    tests/test_fsdp2.py::test_checkpoint_2_ranks_to_3
    tests/test_fsdp2.py::test_mid_window_resume_bf16_masters
)

# prepare VERSION: torch VERSION (with what the smoke subsets need) in a scratch virtualenv, gaengine._C built against
# it in a copy of the working tree ($SCRATCH/src-VERSION).
prepare() {
    local version="$1" scratch="${SCRATCH:-/tmp/gaengine-torch-range}"
    local venv="$scratch/venv-$version" src="$scratch/src-$version"
    # The build tools of pyproject.toml's [build-system] requires (torch aside), the base dependencies, the test tools.
    local reqs
    mapfile -t reqs < <("$PYTHON" -c 'import sys
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))
deps = [r for r in meta["build-system"]["requires"] + meta["project"]["dependencies"] if not r.startswith("torch")]
print("\n".join(["torch==" + sys.argv[1]] + deps + ["pytest", "pytest-xdist>=3.7", "filelock", "hypothesis"]))' "$version")
    if [[ ! -x "$venv/bin/python" ]] || ! printf '%s\n' "${reqs[@]}" | cmp -s - "$venv/.gaengine-smoke-reqs"; then
        rm -rf "$venv"
        TIMEFORMAT="torch $version: virtualenv installed in %0R s (%0U s user, %0S s sys)"
        time { "$PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-compile "${reqs[@]}"; }
        printf '%s\n' "${reqs[@]}" > "$venv/.gaengine-smoke-reqs"
        echo "torch $version: virtualenv $(du -sm "$venv" | cut -f1) MB"
    else
        echo "torch $version: virtualenv reused ($venv)"
    fi
    rm -rf "$src"
    mkdir -p "$src"
    git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$src"
    TIMEFORMAT="torch $version: gaengine._C built against it in %0R s (%0U s user, %0S s sys)"
    time (cd "$src" && PATH="$venv/bin:$PATH" GAENGINE_BUILD_CUDA=0 MAX_JOBS="$jobs" "$venv/bin/python" setup.py -q \
        build_ext --inplace > build.log 2>&1) \
        || { tail -40 "$src/build.log" >&2; echo "FAILED: building gaengine._C against torch $version (log: $src/build.log)" >&2; exit 1; }
}

# run_subset VERSION full|ci: the smoke subset (ci: the CI subset) against torch VERSION, in what prepare left.
run_subset() {
    local version="$1" subset="$2" scratch="${SCRATCH:-/tmp/gaengine-torch-range}"
    local venv="$scratch/venv-$version" src="$scratch/src-$version"
    local tests=("${SMOKE_TESTS[@]}") select=()
    if [[ "$subset" == ci ]]; then
        tests=("${SMOKE_CI_TESTS[@]}")
        select=(-k "not cuda-emu and not emulated and not times_the_real_update")
    fi
    local workers=(-n "$jobs" --dist loadfile)
    [[ "$jobs" -gt 1 ]] || workers=(-n 0)
    TIMEFORMAT="torch $version: the $subset smoke subset run in %0R s (%0U s user, %0S s sys)"
    time (cd "$src" && PATH="$venv/bin:$PATH" PYTHONPATH="$src" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        "${workers[@]}" --durations=10 "${select[@]}" "${tests[@]}")
}

# smoke VERSION: prepare, then the smoke subset.
smoke() {
    local t0=$SECONDS
    prepare "$1"
    run_subset "$1" full
    echo "torch $1: passed, $((SECONDS - t0)) s in all"
}

# ci_tests: the CI subset against both ends at once, one test process each (the multi-rank tests' deadlines, 120 s a
# test, hold on an idle machine), each one's output printed whole once both are done.
ci_tests() {
    local newest_log oldest_log newest_rc=0 oldest_rc=0
    newest_log="$(mktemp)"
    oldest_log="$(mktemp)"
    run_subset 2.14.1 ci > "$newest_log" 2>&1 &
    local newest_pid=$!
    run_subset 2.9.1 ci > "$oldest_log" 2>&1 || oldest_rc=$?
    wait "$newest_pid" || newest_rc=$?
    echo "== torch 2.14.1, the CI subset (exit $newest_rc)"
    cat "$newest_log"
    echo "== torch 2.9.1, the CI subset (exit $oldest_rc)"
    cat "$oldest_log"
    rm -f "$newest_log" "$oldest_log"
    [[ $newest_rc -eq 0 && $oldest_rc -eq 0 ]] || { echo "FAILED: the CI subset against torch 2.14.1 (exit $newest_rc) or 2.9.1 (exit $oldest_rc)" >&2; exit 1; }
}

mode="${1:-headers}"
shift || true
case "$mode" in
headers)
    versions=("$@")
    [[ ${#versions[@]} -gt 0 ]] || versions=(2.9.1 2.14.1)
    for version in "${versions[@]}"; do
        syntax "$version"
    done
    ;;
smoke)
    smoke "${1:?usage: bash .ci/torch_range.sh smoke VERSION}"
    ;;
ci-build)
    prepare 2.14.1
    prepare 2.9.1
    ;;
ci-test)
    jobs=1 ci_tests
    ;;
ci)
    prepare 2.14.1
    prepare 2.9.1
    jobs=1 ci_tests
    ;;
full)
    syntax 2.9.1
    syntax 2.14.1
    smoke 2.14.1
    smoke 2.9.1
    ;;
*)
    echo "usage: bash .ci/torch_range.sh headers [VERSION ...] | smoke VERSION | ci | ci-build | ci-test | full" >&2
    exit 2
    ;;
esac
