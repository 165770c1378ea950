#!/usr/bin/env bash
# The torch range gaengine claims (setup.py's TORCH_SPEC: torch>=2.9,<2.15), checked on a machine without a GPU.
#
#   bash .ci/torch_range.sh headers [VERSION ...]   # csrc/*.cpp compiled (g++ -fsyntax-only) against the headers
#                                                   # of each VERSION's torch (default 2.9.1, the oldest supported)
#   bash .ci/torch_range.sh full                    # headers of 2.9.1 and 2.14.1, then 2.14.1 installed in a
#                                                   # scratch virtualenv, the extension built against it there and
#                                                   # the smoke subset run (`make torch-range`)
#
# Headers: only torch 2.13 has a CPU wheel on the development machine; on x86_64 any other version is a CUDA wheel
# (900 MB for 2.9.1, Python 3.11). The headers come from the version's Linux aarch64 wheel instead (a CPU build, 104
# MB; TORCH_HEADERS_PLATFORM to change it), downloaded once with `pip download --no-deps`, its torch/include (60 MB)
# extracted into $TORCH_HEADERS_CACHE (default ~/.cache/gaengine/torch-headers/VERSION) and the wheel deleted; later
# runs compile at once. The compile is the real build's (setup.py's flags, torch's extension defines, Python's
# headers), without code generation. Environment: PYTHON (default python3), TORCH_HEADERS_CACHE, SCRATCH (the full
# mode's virtualenv and build copy, default /tmp/gaengine-torch-range), JOBS (parallel compiles, default nproc).
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

mode="${1:-headers}"
shift || true
case "$mode" in
headers)
    for version in "${@:-2.9.1}"; do
        syntax "$version"
    done
    ;;
full)
    syntax 2.9.1
    syntax 2.14.1
    scratch="${SCRATCH:-/tmp/gaengine-torch-range}"
    venv="$scratch/venv-2.14.1"
    t0=$SECONDS
    if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.14.1")'; then
        "$PYTHON" -m venv "$venv"
        "$venv/bin/python" -m pip install --disable-pip-version-check -q "torch==2.14.1" numpy tqdm matplotlib \
            pytest hypothesis filelock "setuptools>=64" wheel ninja pybind11
    fi
    echo "torch 2.14.1 virtualenv ready after $((SECONDS - t0)) s ($(du -sm "$venv" | cut -f1) MB)"
    rm -rf "$scratch/src"
    mkdir -p "$scratch/src"
    git ls-files -z | xargs -0 -I{} cp --parents {} "$scratch/src/"
    (cd "$scratch/src" && "$venv/bin/python" setup.py -q build_ext --inplace)
    (cd "$scratch/src" && PYTHONPATH="$scratch/src" "$venv/bin/python" -m pytest -q -n 0 -x -p no:cacheprovider \
        tests/test_hot_path.py tests/test_op_table.py tests/test_zero.py tests/test_fsdp2.py tests/test_plausible.py \
        tests/test_torch_range.py)
    echo "torch 2.14.1: built and smoke-tested after $((SECONDS - t0)) s"
    ;;
*)
    echo "usage: bash .ci/torch_range.sh headers [VERSION ...] | full" >&2
    exit 2
    ;;
esac
