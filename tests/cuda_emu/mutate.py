"""Mutation check of the CUDA emulation layer: plant known kernel bugs in a copy of the kernels (csrc/cuda/kernels.cuh
and the family headers it includes, kernels/*.cuh), one at a time, and see which check of
tests/test_cuda_emulation.py's pipeline catches each.

For every mutant (``MUTANTS``: a family header, relative to csrc/cuda, an exact snippet of it and its replacement,
which must match exactly once unless an occurrence is named) the stages run in CI order, stopping at the first that
fails:

1. ``o2``          the -O2 + -fsanitize=alignment build, ``quick`` cases
2. ``o2-cap3-rev`` the same binary, GAENGINE_EMU_MAX_GRID=3, GAENGINE_EMU_ORDER=reverse
3. ``asan``        the -fsanitize=address,undefined build, ``quick`` cases
4. ``full``        the o2 build, ``full`` cases (GAENGINE_EMU_FULL=1 in the pytest; not in CI's quick run)

and the report is the first failed check (``FAIL [name]``), the emulator's or a sanitizer's message, or a crash or
time-out. ``python tests/cuda_emu/mutate.py [--out MUTATION.md] [--only NAME ...] [--jobs 2]`` writes the table
(default: tests/cuda_emu/MUTATION.md). An unmutated baseline must pass every stage first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build as emu_build  # noqa: E402
import rewrite  # noqa: E402

RUN_TIMEOUT_S = 180

# name, file (relative to csrc/cuda), what it plants, snippet of that file, replacement, occurrence (0: the only one;
# k: the k-th, 1-based)
MUTANTS = [
    ("accumulate-tail-off-by-one", "kernels/accumulate.cuh",
     "accumulate_kernel's scalar tail stops one element short",
     "for (int64_t i = scalar_start + tid; i < n; i += stride) {",
     "for (int64_t i = scalar_start + tid; i < n - 1; i += stride) {", 0),
    ("accumulate-vector-count-rounds-up", "kernels/accumulate.cuh",
     "accumulate_kernel rounds the vector count up: the last vector runs past "
     "the end (its in-range lanes still get the right values)",
     "const int64_t n_vectors = n / kElems;", "const int64_t n_vectors = (n + kElems - 1) / kElems;", 0),
    ("accumulate-no-grid-stride", "kernels/accumulate.cuh",
     "accumulate_kernel's vector loop runs once per thread instead of striding over "
     "the grid (right only when the grid covers the buffer)",
     "for (int64_t v = tid; v < n_vectors; v += stride) {\n      float grad[kElems];",
     "if (int64_t v = tid; v < n_vectors) {\n      float grad[kElems];", 0),
    ("accumulate-overwrite-dropped", "kernels/accumulate.cuh",
     "launch_accumulate drops the unscaled overwrite branch (adds instead)",
     "  } else if (overwrite) {\n    accumulate_kernel<src_t, true, false>",
     "  } else if (false) {\n    accumulate_kernel<src_t, true, false>", 0),
    ("scaled-add-two-roundings", "kernels/accumulate.cuh",
     "the scaled accumulate multiplies then adds (two roundings) instead of one FMA",
     "kOverwrite ? __fmul_rn(grad, scale) : __fmaf_rn(grad, scale, dst)",
     "kOverwrite ? __fmul_rn(grad, scale) : __fadd_rn(dst, __fmul_rn(grad, scale))", 0),
    ("scale-vector-path-unchecked", "kernels/scale.cuh",
     "scale_kernel takes the float4 path without checking the alignment",
     "  if (aligned16(x)) {\n    const int64_t n_vectors = n / 4;", "  if (true) {\n    const int64_t n_vectors = n / 4;", 0),
    ("block-sum-skipped-syncthreads", "kernels/common.cuh",
     "block_sum reads the warps' sums without the barrier after writing them",
     "if (lane == 0) shared[warp] = value;\n  __syncthreads();", "if (lane == 0) shared[warp] = value;", 0),
    ("block-sum-wrong-shuffle-offset", "kernels/common.cuh",
     "the warp tree starts at offset 8: lanes 16..31 never reach lane 0",
     "for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);",
     "for (int offset = 8; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);", 1),
    ("finalize-reads-sums-as-flags", "kernels/norm.cuh",
     "the finalize kernel reads row 0 (the sums) as the non-finite flags",
     "found |= partials[n_partials + i] != 0.f;", "found |= partials[i] != 0.f;", 0),
    ("l2norm-int32-chunk-start", "kernels/norm.cuh",
     "l2norm_sq_partial_kernel computes its chunk start in 32 bits (wraps past 2^31 "
     "elements)",
     "const int64_t begin = static_cast<int64_t>(blockIdx.x) * kNormChunkNumel;",
     "const int64_t begin = static_cast<int>(blockIdx.x * kNormChunkNumel);", 0),
    ("bucket-misaligned-vector", "kernels/bucket.cuh",
     "accumulate_chunk checks only dst's alignment before its 128-bit loads of src",
     "if (aligned16(dst) && aligned16(src)) {  // a chunk starts", "if (aligned16(dst)) {  // a chunk starts", 0),
    ("bucket-one-chunk-per-block", "kernels/bucket.cuh",
     "accumulate_bucket_kernel handles one chunk per block (no grid-stride loop)",
     "for (int64_t c = blockIdx.x; c < params.n_chunks; c += gridDim.x) {  // uniform",
     "if (int64_t c = blockIdx.x; c < params.n_chunks) {  // uniform", 0),
    ("bucket-dropped-overwrite", "kernels/bucket.cuh",
     "the bucket kernel ignores the overwrite flag (adds into the slice)",
     "const bool overwrite = e.overwrite != 0;", "const bool overwrite = false;", 0),
    ("bucket-chunk-boundary", "kernels/bucket.cuh",
     "a full bucket chunk is 4095 elements: the last element of every full chunk is skipped",
     "e.numel - begin : kBucketChunkNumel);", "e.numel - begin : kBucketChunkNumel - 1);", 0),
    ("find-tensor-off-by-one", "kernels/common.cuh",
     "find_tensor's binary search takes chunk_start[mid] < c: a tensor's first chunk goes "
     "to the tensor before",
     "if (chunk_start[mid] <= c) {", "if (chunk_start[mid] < c) {", 0),
    ("bucket-int32-dst-offset", "kernels/bucket.cuh",
     "the bucket kernel forms its dst pointer with a 32-bit element offset",
     "float* dst = params.dst + e.dst_offset + begin;",
     "float* dst = params.dst + static_cast<int>(e.dst_offset + begin);", 0),
    ("bucket-partials-column-base", "kernels/bucket.cuh",
     "partials columns ignore the launch's chunk_base (split buckets overwrite the "
     "first launch's columns)",
     "const int64_t column = params.chunk_base + c;", "const int64_t column = c;", 0),
    ("adamw-model-alignment-unchecked", "kernels/optimizer.cuh",
     "optimizer_chunk takes its vector path without checking the model "
     "parameter's 8-byte alignment (64-bit stores)",
     "(!kHasModel || aligned_to(model, 8))) {", "true) {", 0),
    ("adamw-found-inf-ignored", "kernels/optimizer.cuh",
     "optimizer_multi_kernel ignores found_inf",
     "if (params.found_inf != nullptr && *params.found_inf != 0.f) return;",
     "if (false) return;", 0),
    ("adamw-first-block-bumps-steps", "kernels/optimizer.cuh",
     "the FIRST block to finish (not the last) increments the step counts",
     "is_last = atomicAdd(params.counter, 1u) == gridDim.x - 1;", "is_last = atomicAdd(params.counter, 1u) == 0;", 0),
    ("adamw-highest-block-assumed-last", "kernels/optimizer.cuh",
     "the block with the highest index (not the last to finish) increments "
     "the step counts",
     "is_last = atomicAdd(params.counter, 1u) == gridDim.x - 1;",
     "is_last = (atomicAdd(params.counter, 1u), blockIdx.x == gridDim.x - 1);", 0),
    ("adamw-counter-not-reset", "kernels/optimizer.cuh",
     "the last block does not reset the launch counter",
     "    if (threadIdx.x == 0) *params.counter = 0u;\n", "", 0),
    ("adamw-model-nan-sign", "kernels/optimizer.cuh",
     "the bf16 model write keeps a NaN's sign and payload (c10 writes 0x7FC0)",
     "return isnan(x) ? 0x7FC0u : rounded;", "return rounded;", 0),
    ("adamw-missing-threadfence", "kernels/optimizer.cuh",
     "no __threadfence before the last-block atomic (the threadFenceReduction pattern)",
     "      __threadfence();\n      is_last", "      is_last", 0),
    ("adamw-no-barrier-before-signal", "kernels/optimizer.cuh",
     "no __syncthreads between a block's chunk work and thread 0's 'done' "
     "atomic: a lagging thread may read a step the last block already bumped",
     "    __shared__ bool is_last;\n    __syncthreads();\n", "    __shared__ bool is_last;\n", 0),
]

STAGES = [
    ("o2", "o2", "quick", {}),
    ("o2-cap3-rev", "o2", "quick", {"GAENGINE_EMU_MAX_GRID": "3", "GAENGINE_EMU_ORDER": "reverse"}),
    ("asan", "asan", "quick", {}),
    ("full", "o2", "full", {}),
]


def mutate(text: str, snippet: str, replacement: str, occurrence: int) -> str:
    count = text.count(snippet)
    if occurrence == 0:
        if count != 1:
            raise ValueError(f"snippet found {count} times, expected once: {snippet!r}")
        return text.replace(snippet, replacement)
    if count < occurrence:
        raise ValueError(f"snippet found {count} times, expected at least {occurrence}: {snippet!r}")
    start = -1
    for _ in range(occurrence):
        start = text.index(snippet, start + 1)
    return text[:start] + replacement + text[start + len(snippet):]


def diagnose(rc: int | None, out: str) -> str:
    """The first report of a failed run, in a few words."""
    if rc is None:
        return f"time-out ({RUN_TIMEOUT_S} s)"
    m = re.search(r"FAIL \[([^\n]*)\] ", out)  # check names may hold brackets: up to the last "] "
    if m:
        return f"check `{m.group(1)}`"
    m = re.search(r"gaemu: (deadlock|error) in kernel ([^,]+)", out)
    if m:
        return f"emulator {m.group(1)} in `{m.group(2)}`"
    m = re.search(r"AddressSanitizer: ([\w-]+)", out)
    if m:
        return f"ASan {m.group(1)}"
    m = re.search(r"runtime error: [^\n]*misaligned address [^\n]*for type '(?:const )?(?:struct )?(\w+)', which "
                  r"requires (\d+) byte alignment", out)
    if m:
        return f"UBSan: misaligned `{m.group(1)}` access ({m.group(2)}-byte alignment required)"
    m = re.search(r"runtime error: ([^\n]{0,70})", out)
    if m:
        return f"UBSan: {m.group(1)}"
    m = re.search(r"(free\(\)|malloc\(\)|double free|corrupted)[^\n]{0,50}", out)
    if m:
        return f"glibc heap-corruption abort (`{m.group(0).strip()}`)"
    if rc < 0:
        return {11: "crash (SIGSEGV)", 6: "abort (SIGABRT)", 7: "crash (SIGBUS)"}.get(-rc, f"crash (signal {-rc})")
    return f"exit {rc}"


def run_stage(binary: str, case_set: str, env: dict) -> tuple[int | None, str]:
    try:
        proc = subprocess.run([binary, case_set], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={**os.environ, **env})
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    return proc.returncode, proc.stdout + proc.stderr


def evaluate(name: str, tree: dict[str, str], work: str) -> dict:
    """Runs the stages on the kernels tree ``tree`` ({path relative to csrc/cuda: text}, the umbrella first);
    returns {stage, report, seconds} (stage None: survived)."""
    t0 = time.time()
    for rel, text in tree.items():
        path = os.path.join(work, name, "kernels", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    kernels = os.path.join(work, name, "kernels", next(iter(tree)))
    binaries = {}
    for stage, variant, case_set, env in STAGES:
        if variant not in binaries:
            try:
                binaries[variant] = emu_build.build(variant, os.path.join(work, name, variant), kernels,
                                                    targets=("run_kernels",), jobs=1)["run_kernels"]
            except emu_build.BuildError as e:
                return {"stage": "build", "report": "does not compile: " + str(e).splitlines()[-1][:80],
                        "seconds": time.time() - t0}
        rc, out = run_stage(binaries[variant], case_set, env)
        if rc != 0:
            return {"stage": stage, "report": diagnose(rc, out), "seconds": time.time() - t0}
    return {"stage": None, "report": "", "seconds": time.time() - t0}


WHY_MISSED = {
    "l2norm-int32-chunk-start": "needs a tensor of more than 2^31 elements (8 GiB written through the kernel: "
                                "every element is touched, no sparse trick applies)",
    "adamw-missing-threadfence": "blocks run one after another, so every write is visible before the next "
                                 "block's atomic: weak memory ordering cannot be observed",
    "adamw-no-barrier-before-signal": "a race between barriers: blocks run one after another, so no block can "
                                      "finish (and bump the steps) while another block's thread still reads them",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "MUTATION.md"))
    parser.add_argument("--only", action="append", help="run only these mutants")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--kernels", default=emu_build.KERNELS, help="the umbrella header of the kernels tree")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.abspath(args.kernels))
    original = {}
    for rel in rewrite.tree_files(args.kernels):
        with open(os.path.join(root, rel)) as f:
            original[rel] = f.read()
    mutants = [m for m in MUTANTS if not args.only or m[0] in args.only]
    sources = {}
    for name, path, _, snippet, repl, occ in mutants:
        if path not in original:
            raise ValueError(f"mutant {name}: no {path} in the tree of {args.kernels}")
        sources[name] = {**original, path: mutate(original[path], snippet, repl, occ)}
    with tempfile.TemporaryDirectory(prefix="gaengine-mutants-") as work:
        baseline = evaluate("baseline", original, work)
        if baseline["stage"] is not None:
            print(f"the unmutated kernels fail at stage {baseline['stage']}: {baseline['report']}", file=sys.stderr)
            return 1
        print(f"baseline passes every stage ({baseline['seconds']:.0f} s)", flush=True)
        results = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(evaluate, name, src, work): name for name, src in sources.items()}
            for fut in concurrent.futures.as_completed(futures):
                name = futures[fut]
                results[name] = fut.result()
                r = results[name]
                print(f"{name}: {'SURVIVED' if r['stage'] is None else r['stage'] + ': ' + r['report']} "
                      f"({r['seconds']:.0f} s)", flush=True)
    caught = sum(r["stage"] is not None for r in results.values())
    caught_ci = sum(r["stage"] not in (None, "full") for r in results.values())
    lines = [
        "# Mutation check of the CUDA emulation layer",
        "",
        "Generated by `python tests/cuda_emu/mutate.py` (do not edit by hand). Each mutant plants one bug in a copy of",
        "the kernels (`csrc/cuda/kernels.cuh` and its `kernels/*.cuh`, the file named below); the stages of",
        "`tests/test_cuda_emulation.py` run in order until one fails: `o2`",
        "(-O2 + -fsanitize=alignment, quick cases), `o2-cap3-rev` (GAENGINE_EMU_MAX_GRID=3, reverse order), `asan`",
        "(-fsanitize=address,undefined, quick cases), `full` (the full cases, GAENGINE_EMU_FULL=1, not in CI's quick",
        "run). \"Caught by\" is the first failing stage and its first report.",
        "",
        f"**Caught: {caught} / {len(results)} planted** ({caught_ci} by the CI quick run, {caught - caught_ci} only by the "
        f"full run).",
        "",
        "| mutant | file | what it plants | caught by |",
        "|---|---|---|---|",
    ]
    for name, path, what, _, _, _ in mutants:
        r = results[name]
        by = f"**not caught**: {WHY_MISSED.get(name, 'see below')}" if r["stage"] is None else f"`{r['stage']}`: {r['report']}"
        lines.append(f"| `{name}` | `{path}` | {what} | {by} |")
    missed = [n for n in results if results[n]["stage"] is None]
    lines += ["", "Not caught, and why:" if missed else "Every mutant was caught.", ""]
    for name in missed:
        lines.append(f"- `{name}`: {WHY_MISSED.get(name, 'no check observes it')}.")
    with open(args.out, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"caught {caught} / {len(results)} (CI quick run: {caught_ci}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
