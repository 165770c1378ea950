"""The CUDA kernels of ``csrc/cuda/kernels.cuh``, EXECUTED on CPU: no GPU, no nvcc, only a C++ compiler.

``tests/cuda_emu`` holds a host shim (``cuda_runtime.h``, ``cuda_bf16.h``, ``cuda_fp16.h``: every CUDA thread a
fiber, real ``__syncthreads`` and warp-shuffle exchanges, IEEE intrinsics, 16-byte-aligned vector types) under
which the unmodified header compiles with g++ once ``rewrite.py`` has turned its ``<<<...>>>`` launches into calls.
``run_kernels.cpp`` runs every kernel through its host launcher against the CPU kernels of ``csrc/`` (bitwise),
host replays of the documented reduction orders (bitwise) and fp64 oracles (``tests/tolerances.py``'s budgets);
``shim_selftest.cpp`` checks the shim itself and that planted errors abort. What this proves and what it cannot:
``csrc/cuda/README.md``, "Executed on CPU: the emulation layer".

CI (about a minute on 2 cores): an ``-O2 -fsanitize=alignment`` build over every case, again with the grids of
the grid-stride kernels capped at 3 blocks (``GAENGINE_EMU_MAX_GRID``: several chunks and loop trips per block)
and blocks / threads scheduled in reverse order, and an ``-fsanitize=address,undefined`` build over the same
cases. ``GAENGINE_EMU_FULL=1`` adds the ``full`` variant (``slow``): a bucket whose slices lie past 2^31
elements of dst (8 GiB of address space, a few pages backed), a 1-block grid cap, every fp32 -> bf16 / fp16
conversion against c10. Skipped only when no C++ compiler is found.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EMU = os.path.join(HERE, "cuda_emu")
sys.path.insert(0, EMU)
import build as emu_build  # noqa: E402
import rewrite  # noqa: E402

CXX = emu_build.find_cxx()
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler ($CXX, g++, c++, clang++) to build the emulation")
FULL = os.environ.get("GAENGINE_EMU_FULL") == "1"
RUN_TIMEOUT_S = 600
# The quick case list runs ~12 000 checks; a much lower count means cases were skipped, not passed.
MIN_CHECKS = {"quick": 11000, "full": 11000}


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    """{variant: {target: path}}: the o2 and asan builds, compiled side by side."""
    out = tmp_path_factory.mktemp("cuda_emu")
    variants = ("o2", "asan")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {v: pool.submit(emu_build.build, v, str(out / v), jobs=1) for v in variants}
        try:
            return {v: f.result() for v, f in futures.items()}
        except emu_build.BuildError as e:
            pytest.fail(f"the emulation does not build:\n{e}")


def _run(binary, *args, env=None):
    proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def _assert_passed(binary, case_set, env=None):
    rc, out = _run(binary, case_set, env=env)
    tail = out[-6000:]
    assert rc == 0, f"{os.path.basename(binary)} {case_set} {env or ''} exited {rc}:\n{tail}"
    m = re.search(r"emu: (\d+) checks passed \(", out)
    assert m, f"no summary line:\n{tail}"
    assert int(m.group(1)) >= MIN_CHECKS[case_set], f"only {m.group(1)} checks ran:\n{tail}"


# --- the rewrite -----------------------------------------------------------------------------------------------

def test_rewrite_turns_every_launch_into_a_call_and_keeps_the_lines(tmp_path):
    root = os.path.dirname(emu_build.KERNELS)
    rels = rewrite.tree_files(emu_build.KERNELS)
    n = rewrite.rewrite_tree(emu_build.KERNELS, str(tmp_path), require_caps=True)
    texts, launches = {}, 0
    for rel in rels:
        with open(os.path.join(root, rel)) as f:
            text = f.read()
        new = (tmp_path / rel).read_text()
        assert new.startswith(f'#line 1 "{os.path.join(root, rel)}"\n')
        new = new.split("\n", 1)[1]
        assert "<<<" not in new and ">>>" not in new, rel
        assert new.count("\n") == text.count("\n"), f"{rel}: the rewrite moved lines: reports would point elsewhere"
        texts[rel], launches = new, launches + text.count("<<<")
    assert n == launches > 0
    new = "".join(texts.values())
    assert new.count("::gaemu::max_grid<int64_t>(65536)") == 1
    assert "::gaemu::launch(&accumulate_kernel<src_t, true, true>, \"accumulate_kernel<src_t, true, true>\"" in new


def test_rewrite_tree_covers_every_family_header_the_umbrella_includes(tmp_path):
    """The umbrella includes every kernels/*.cuh (none left out of the builds), and the rewrite takes them all."""
    rels = rewrite.tree_files(emu_build.KERNELS)
    assert rels[0] == "kernels.cuh"
    assert {"kernels/common.cuh", "kernels/accumulate.cuh", "kernels/norm.cuh", "kernels/scale.cuh",
            "kernels/bucket.cuh", "kernels/adamw.cuh"} <= set(rels)
    with open(emu_build.KERNELS) as f:
        included = set(re.findall(r'^#include "([^"]+)"', f.read(), re.M))
    assert included == set(rels[1:])
    # a grid cap must be defined exactly once in the whole tree
    (tmp_path / "src" / "kernels").mkdir(parents=True)
    (tmp_path / "src" / "kernels.cuh").write_text('#include "kernels/a.cuh"\n#include "kernels/b.cuh"\n')
    for name in ("a", "b"):
        (tmp_path / "src" / "kernels" / f"{name}.cuh").write_text("constexpr int64_t kMaxBlocks = 4;\n")
    with pytest.raises(rewrite.RewriteError, match="exactly once"):
        rewrite.rewrite_tree(str(tmp_path / "src" / "kernels.cuh"), str(tmp_path / "out"), require_caps=True)
    (tmp_path / "src" / "kernels" / "b.cuh").write_text("k<<<1, 2>>>(x);\n")
    assert rewrite.rewrite_tree(str(tmp_path / "src" / "kernels.cuh"), str(tmp_path / "out"), require_caps=True) == 1
    assert "::gaemu::max_grid<int64_t>(4)" in (tmp_path / "out" / "kernels" / "a.cuh").read_text()


def test_rewrite_handles_templates_qualified_names_and_multiline_arguments():
    src = "ns::k<T, (A > 1), 3><<<dim3(g, 1), b>>>(\n  f(x, y),\n  z);\nk2<<<\n1, 2, 0, s>>>(p);\n"
    new, n = rewrite.rewrite(src, caps=())
    assert n == 2
    assert new == ('::gaemu::launch(&ns::k<T, (A > 1), 3>, "ns::k<T, (A > 1), 3>", dim3(g, 1), b)(\n  f(x, y),\n  z);\n'
                   '::gaemu::launch(&k2, "k2", 1, 2, 0, s)\n(p);\n')
    with pytest.raises(rewrite.RewriteError):
        rewrite.rewrite("k<<<1, 2>>>;", caps=())  # no argument list
    with pytest.raises(rewrite.RewriteError):
        rewrite.rewrite("int x;", caps=("kMaxBlocks",), require_caps=True)


# --- the shim ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["o2", "asan"])
def test_shim_semantics(binaries, variant):
    rc, out = _run(binaries[variant]["shim_selftest"], "quick")
    assert rc == 0 and "shim: " in out and "FAIL" not in out, out[-4000:]


# Each planted error, the build that must catch it, and the report expected.
PLANTS = {
    "misaligned-float4": ("o2", r"misaligned address .* for type 'const struct float4', which requires 16 byte"),
    "shared-overflow": ("asan", r"AddressSanitizer: global-buffer-overflow|runtime error: store to address .* with "
                                r"insufficient space"),
    "divergent-warp-op": ("o2", r"gaemu: deadlock in kernel divergent_warp_op_kernel"),
    "shfl-outside-mask": ("o2", r"lane 8 reads lane 16, which is not in the mask"),
    "shfl-exited-lane": ("o2", r"gaemu: (deadlock|error) in kernel shfl_exited_lane_kernel"),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_planted_errors_abort(binaries, plant):
    variant, report = PLANTS[plant]
    rc, out = _run(binaries[variant]["shim_selftest"], f"plant:{plant}")
    assert rc != 0 and "NOT caught" not in out, f"plant {plant} ran to the end:\n{out[-3000:]}"
    assert re.search(report, out), f"plant {plant}: expected a report matching {report!r}:\n{out[-3000:]}"


# --- the kernels ------------------------------------------------------------------------------------------------

def test_kernels_o2(binaries):
    _assert_passed(binaries["o2"]["run_kernels"], "quick")


def test_kernels_o2_grid_capped_reverse_order(binaries):
    _assert_passed(binaries["o2"]["run_kernels"], "quick", {"GAENGINE_EMU_MAX_GRID": "3", "GAENGINE_EMU_ORDER": "reverse"})


def test_kernels_address_and_undefined_sanitizers(binaries):
    _assert_passed(binaries["asan"]["run_kernels"], "quick")


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the full emulation run: set GAENGINE_EMU_FULL=1")
@pytest.mark.parametrize("variant, env", [("o2", {}), ("o2", {"GAENGINE_EMU_MAX_GRID": "1"}), ("asan", {})],
                         ids=["o2", "o2-grid1", "asan"])
def test_kernels_full(binaries, variant, env):
    _assert_passed(binaries[variant]["run_kernels"], "full", env)
    rc, out = _run(binaries[variant]["shim_selftest"], "full")
    assert rc == 0, out[-4000:]
