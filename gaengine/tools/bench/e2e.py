"""End-to-end benchmark (``e2e``): the byte-level GPT of :mod:`gaengine.tools.model` (bf16 where the machine
computes bf16 fast, else fp32) through gaengine, the plain recipe and torch's native fp32 accumulation: throughput
in interleaved rounds, peak memory and state bytes in a fresh process per variant; a table.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

import torch

from gaengine import compat
from gaengine.engine import GradientAccumulator
from gaengine.optim import FusedAdamW
from gaengine.tools.bench.common import (MIN_ROUNDS, PACKAGE_ROOT, RATIO_NOTE, display_rows, median_ratio, print_note,
                                         print_table, ratio_stats, sync, time_rounds, without_kineto_log)
from gaengine.tools.capability import choose_param_dtype
from gaengine.tools.model import GPT, GPTConfig
from gaengine.tools.train import DTYPES

E2E_VARIANTS = {
    "gaengine-fused": "(a) gaengine: GradientAccumulator + gaengine.optim.FusedAdamW",
    "gaengine-torch": "(a') gaengine: GradientAccumulator + torch AdamW(fused=True)",
    "gaengine-lean": "(a'') gaengine, master_weights=False: torch AdamW(fused) in the params' dtype",
    "plain": "(b) plain: .grad in the params' dtype, (loss/K).backward(), clip, AdamW(fused)",
    "native-fp32": "(c) native: grad_dtype=fp32, clip, AdamW(fused) on fp32 masters",
}
"""End-to-end variants: key -> label. The plain recipe ``plain`` is the baseline of the ratio."""

E2E_BASELINE = "plain"


@dataclass(frozen=True, kw_only=True)
class E2EConfig:
    """Shape and length of the end-to-end benchmark; every variant runs this same configuration."""

    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    n_layers: int = 4
    """Transformer blocks of the GPT."""
    d_model: int = 256
    """Residual width."""
    n_heads: int = 4
    """Attention heads."""
    seq_len: int = 128
    """Tokens (bytes) per sequence; also the model's context length."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    accumulation_steps: int = 8
    """Micro-batches per update (K)."""
    warmup_updates: int = 1
    """Untimed updates of every variant first (optimizer state allocated, kernels warmed up); >= 1."""
    timed_updates: int = 5
    """Timed rounds; each round times one update of every variant, one after the other."""
    seed: int = 0
    """Initialization and data seed (the same for every variant)."""
    dtype: str = "bf16"
    """Parameter dtype, ``bf16`` or ``fp32``; :func:`e2e_config` picks it for the machine
    (:func:`gaengine.tools.capability.choose_param_dtype`)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "micro_batch_size", "accumulation_steps",
                     "warmup_updates", "timed_updates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")

    @property
    def tokens_per_update(self) -> int:
        """``micro_batch_size * seq_len * accumulation_steps`` (every position is a predicted token)."""
        return self.micro_batch_size * self.seq_len * self.accumulation_steps


def e2e_config(device: str, quick: bool = False) -> E2EConfig:
    """The end-to-end configuration for ``device``: GPT-2 small (124 M with the byte vocabulary: 85 M) on CUDA,
    a 3.3 M-parameter GPT on CPU (about 30 s for the four variants on two cores), a tiny one with ``quick``; bf16
    parameters where the machine computes bf16 fast, else fp32 (:func:`gaengine.tools.capability.choose_param_dtype`:
    an AVX2-only CPU runs a bf16 matmul 20-30x slower than fp32)."""
    dtype = choose_param_dtype(device).dtype
    if quick:
        return E2EConfig(device=device, n_layers=2, d_model=64, n_heads=2, seq_len=32, micro_batch_size=2,
                         warmup_updates=1, timed_updates=MIN_ROUNDS, dtype=dtype)
    if device == "cuda":
        return E2EConfig(device=device, n_layers=12, d_model=768, n_heads=12, seq_len=1024, micro_batch_size=8,
                         warmup_updates=2, timed_updates=10, dtype=dtype)
    return E2EConfig(device=device, dtype=dtype)


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``; else the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process image: Linux ``VmHWM``, else ``ru_maxrss``.

    ``VmHWM`` starts afresh at ``exec``; ``ru_maxrss`` does not (Linux carries the parent's RSS at ``fork``
    into the child's ``ru_maxrss``), so a child started by a large parent would report the parent's size.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS


def _state_bytes(tensors: Sequence[torch.Tensor | None], exclude: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those of ``exclude`` (the model params)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters (fp32 masters, when it holds them), their grads, and its state tensors."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out += [p, p.grad]
            out += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


@dataclass
class _Variant:
    """One end-to-end variant on its own model: ``accumulate(window) -> loss sum``, ``update()``, ``state()``."""

    model: torch.nn.Module
    accumulate: Callable[[list], torch.Tensor]
    update: Callable[[], None]
    state: Callable[[], list]  # tensors holding its gradients and optimizer state


def _e2e_model(cfg: E2EConfig) -> torch.nn.Module:
    """The GPT of ``cfg`` in ``cfg.dtype``, initialized from ``cfg.seed`` in fp32 (the same weights for every
    variant)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig(context_len=cfg.seq_len, n_layers=cfg.n_layers, d_model=cfg.d_model,
                              n_heads=cfg.n_heads))
    return model.to(device=cfg.device, dtype=DTYPES[cfg.dtype]).train()


def _e2e_windows(cfg: E2EConfig, n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``n`` windows of K micro-batches ``(x, y)`` of random bytes, ``(micro_batch_size, seq_len)`` int64 each."""
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, 256, (n, cfg.accumulation_steps, cfg.micro_batch_size, cfg.seq_len + 1), generator=g)
    tokens = tokens.to(cfg.device)
    return [[(mb[:, :-1], mb[:, 1:]) for mb in window] for window in tokens]


_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
"""AdamW hyper-parameters of every end-to-end variant."""
_MAX_NORM = 1.0
"""Gradient clipping norm of every end-to-end variant."""


def _accumulate(model: torch.nn.Module, cfg: E2EConfig,
                backward: Callable[[torch.Tensor], object]) -> Callable[[list], torch.Tensor]:
    """A variant's ``accumulate``: forward each micro-batch of the window, ``backward(loss)``; returns the loss sum."""

    def accumulate(window):
        loss_sum = torch.zeros((), device=cfg.device)
        for x, y in window:
            loss = model(x, y)
            backward(loss)
            loss_sum += loss.detach()
        return loss_sum
    return accumulate


def _plain_accumulate(model: torch.nn.Module, cfg: E2EConfig) -> Callable[[list], torch.Tensor]:
    """The recipe's ``accumulate``: ``(loss / K).backward()`` per micro-batch into ``.grad``; returns the loss sum."""
    k = cfg.accumulation_steps
    return _accumulate(model, cfg, lambda loss: (loss / k).backward())


def _gaengine_variant(variant: str, cfg: E2EConfig, model: torch.nn.Module) -> _Variant:
    """``gaengine-fused`` / ``-torch`` / ``-lean``: a ``GradientAccumulator`` (fp32 masters but in ``-lean``)
    with gaengine's ``FusedAdamW`` or torch's ``AdamW(fused=True)``; ``acc.backward`` per micro-batch."""
    params = list(model.parameters())
    opt = FusedAdamW(params, **_ADAMW) if variant == "gaengine-fused" else torch.optim.AdamW(
        params, **_ADAMW, fused=True)
    acc = GradientAccumulator(model, opt, accumulation_steps=cfg.accumulation_steps, max_grad_norm=_MAX_NORM,
                              master_weights=variant != "gaengine-lean")

    def state():
        buffers = [acc.main_grad.data] + ([acc.master_buffer.data] if acc.master_buffer is not None else [])
        return buffers + _optimizer_tensors(opt) + [p.grad for p in params]

    return _Variant(model, _accumulate(model, cfg, acc.backward), acc.step, state)


def _plain_variant(cfg: E2EConfig, model: torch.nn.Module) -> _Variant:
    """``plain``: ``.grad`` in the parameters' dtype, ``clip_grad_norm_``, ``AdamW(fused=True)``, ``zero_grad``."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, **_ADAMW, fused=True)

    def update():
        torch.nn.utils.clip_grad_norm_(params, _MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _Variant(model, _plain_accumulate(model, cfg), update, lambda: _optimizer_tensors(opt))


def _native_fp32_variant(cfg: E2EConfig, model: torch.nn.Module) -> _Variant:
    """``native-fp32``: autograd accumulates in fp32 (``Tensor.grad_dtype``, torch >= 2.10), clip and
    ``AdamW(fused=True)`` on fp32 masters copied back into the model. Raises ``RuntimeError`` on an older torch."""
    if not compat.has_grad_dtype():
        raise RuntimeError(f"torch {torch.__version__} has no Tensor.grad_dtype (added in 2.10): no native "
                           "fp32 accumulation of bf16 gradients to compare with")
    params = list(model.parameters())
    for p in params:
        p.grad_dtype = torch.float32  # autograd casts each incoming bf16 grad, then accumulates in fp32
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = torch.optim.AdamW(masters, **_ADAMW, fused=True)

    def update():
        for m, p in zip(masters, params):
            m.grad = p.grad  # the fp32 .grad itself (no copy)
        torch.nn.utils.clip_grad_norm_(masters, _MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)  # fp32 master -> bf16 model

    return _Variant(model, _plain_accumulate(model, cfg), update,
                    lambda: _optimizer_tensors(opt) + [p.grad for p in params])


def _build_variant(variant: str, cfg: E2EConfig, model: torch.nn.Module | None = None) -> _Variant:
    """The update path of ``variant`` (a key of :data:`E2E_VARIANTS`) over ``model`` (default: a fresh one)."""
    model = _e2e_model(cfg) if model is None else model
    if variant in ("gaengine-fused", "gaengine-torch", "gaengine-lean"):
        return _gaengine_variant(variant, cfg, model)
    if variant == "plain":
        return _plain_variant(cfg, model)
    if variant == "native-fp32":
        return _native_fp32_variant(cfg, model)
    raise ValueError(f"unknown e2e variant {variant!r}; expected one of {sorted(E2E_VARIANTS)}")


def e2e_throughput(cfg: E2EConfig, variants: Sequence[str]) -> dict[str, dict]:
    """Train every variant in this process on its own model, round-robin: one update of each per round.

    Round ``r`` feeds every variant the same window of micro-batches. Returns variant -> ``{"update_ms": [wall
    ms of each timed round], "cpu_ms": [process CPU ms of each timed round], "losses": [window mean loss of
    every update]}``. With one torch thread, CPU time leaves out the time this process waited descheduled on a
    CPU shared with other jobs (with more threads it also counts their spin-waits); it does not remove their
    competition for memory bandwidth.
    """
    built = {v: _build_variant(v, cfg) for v in variants}
    windows = _e2e_windows(cfg, cfg.warmup_updates + cfg.timed_updates)
    losses: dict[str, list[torch.Tensor]] = {v: [] for v in variants}

    def one_update(v: str, b: _Variant, next_window: Callable[[], list]) -> Callable[[], None]:
        def update() -> None:  # each call takes the next window: round r feeds every variant windows[r]
            losses[v].append(b.accumulate(next_window()) / cfg.accumulation_steps)
            b.update()
        return update

    timed = time_rounds({v: one_update(v, b, iter(windows).__next__) for v, b in built.items()},
                        device=torch.device(cfg.device), warmup=cfg.warmup_updates, repeats=cfg.timed_updates,
                        shuffle=False)
    return {v: {"update_ms": timed.ms[v], "cpu_ms": timed.cpu_ms[v],
                "losses": torch.stack(losses[v]).float().tolist()}  # one host read, after timing
            for v in variants}


def _peak_live_cpu_bytes(run: Callable[[], None]) -> int:
    """Peak bytes of CPU tensors allocated inside ``run()`` and alive at once: the largest running total of
    ``torch.profiler``'s allocation events (``profile_memory=True``). Tensors that existed before ``run`` are
    not counted; no allocator slack, unlike RSS."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp, without_kineto_log():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events
                if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0), default=0)


def _e2e_memory_worker(variant: str, cfg: E2EConfig) -> dict:
    """In a fresh process: ``warmup_updates + 1`` updates of ``variant``; its peak memory and state bytes.

    A tiny model of the same variant trains first, so that lazy imports and first-use allocations of torch's
    kernels (about 150 MiB of RSS on CPU, whatever the model size) happen before the baseline is taken. On
    CPU the same updates then run again on a fresh model under ``torch.profiler`` for the peak of live tensor
    bytes (after the RSS peak was read: the profiler's own buffers do not count).
    """
    device = torch.device(cfg.device)
    tiny = replace(cfg, n_layers=1, d_model=8 * cfg.n_heads, seq_len=8, micro_batch_size=1, accumulation_steps=2)
    warm = _build_variant(variant, tiny)
    for window in _e2e_windows(tiny, 2):
        warm.accumulate(window)
        warm.update()
    del warm, window
    gc.collect()
    model = _e2e_model(cfg)
    windows = _e2e_windows(cfg, cfg.warmup_updates + 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_bytes = torch.cuda.memory_allocated()
    else:
        base_bytes = _rss_bytes()
    state_bytes = 0

    def train(model: torch.nn.Module) -> None:
        nonlocal state_bytes
        b = _build_variant(variant, cfg, model)
        for i, window in enumerate(windows):
            b.accumulate(window)
            if i == len(windows) - 1:  # the high point of gradient + optimizer state (optimizer state exists by now)
                state_bytes = _state_bytes(b.state(), exclude=list(b.model.parameters()))
            b.update()
        sync(device)

    train(model)
    num_params = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        peak_bytes, kind = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
        live_bytes = peak_bytes - base_bytes
    else:
        peak_bytes, kind = _peak_rss_bytes(), "peak RSS (VmHWM)"
        del model
        gc.collect()
        fresh = _e2e_model(cfg)
        live_bytes = _peak_live_cpu_bytes(lambda: train(fresh))
    return {"variant": variant, "num_params": num_params, "peak_bytes": peak_bytes,
            "peak_delta_bytes": peak_bytes - base_bytes, "peak_kind": kind, "state_bytes": state_bytes,
            "peak_live_bytes": live_bytes}


_WORKER_MARK = "GAENGINE_E2E_RESULT "


def _run_memory_subprocess(variant: str, cfg: E2EConfig) -> dict:
    """``_e2e_memory_worker`` in a fresh interpreter, so its peak is its own; raises with its stderr on failure."""
    code = ("import json, sys; from gaengine.tools.bench import e2e; cfg = e2e.E2EConfig(**json.loads(sys.argv[2])); "
            f"print({_WORKER_MARK!r} + json.dumps(e2e._e2e_memory_worker(sys.argv[1], cfg)))")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # the parent's thread count
    proc = subprocess.run([sys.executable, "-c", code, variant, json.dumps(asdict(cfg))], capture_output=True,
                          text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(_WORKER_MARK):
            return json.loads(line[len(_WORKER_MARK):])
    raise RuntimeError(f"e2e memory run of {variant!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def bench_e2e(cfg: E2EConfig, variants: Sequence[str] = tuple(E2E_VARIANTS), *,
              progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
    """Throughput of every variant (in this process, interleaved) and its peak memory (a fresh subprocess each).

    Returns one row per variant (median update ms, tokens/s at that median, the median per-round speedup over
    the plain recipe, peak memory, state bytes, losses) and the run's facts (parameter count, what memory means).
    """
    variants = list(dict.fromkeys([*variants, E2E_BASELINE]))  # the baseline always runs
    progress = progress or (lambda s: None)
    progress(f"e2e throughput: {len(variants)} variants x ({cfg.warmup_updates} + {cfg.timed_updates}) updates, "
             "interleaved")
    timing = e2e_throughput(cfg, variants)
    memory = {}
    for v in variants:
        progress(f"e2e memory: {v} (fresh process)")
        memory[v] = _run_memory_subprocess(v, cfg)
    base_ms = timing[E2E_BASELINE]["update_ms"]
    mib = 2.0**20
    rows = []
    for v in variants:
        t, m = timing[v], memory[v]
        ms = statistics.median(t["update_ms"])
        rows.append({
            "benchmark": f"e2e GPT {cfg.dtype}, K={cfg.accumulation_steps}",
            "variant": E2E_VARIANTS[v],
            "key": v,
            "device": cfg.device,
            "ms": ms,
            "min_ms": min(t["update_ms"]),
            "max_ms": max(t["update_ms"]),
            "update_ms": t["update_ms"],
            "cpu_ms": statistics.median(t["cpu_ms"]),
            "cpu_ms_runs": t["cpu_ms"],
            "ratio_cpu_time": median_ratio(timing[E2E_BASELINE]["cpu_ms"], t["cpu_ms"]),
            "tokens_per_s": cfg.tokens_per_update / (ms * 1e-3),
            **ratio_stats(base_ms, t["update_ms"], baseline=v == E2E_BASELINE),
            "peak_mib": m["peak_bytes"] / mib,
            "peak_delta_mib": m["peak_delta_bytes"] / mib,
            "peak_live_mib": m["peak_live_bytes"] / mib,
            "state_mib": m["state_bytes"] / mib,
            "state_bytes_per_param": m["state_bytes"] / m["num_params"],
            "final_loss": t["losses"][-1],
            "losses": t["losses"],
        })
    if cfg.device == "cuda":
        how = ("peak = torch.cuda.max_memory_allocated of the variant's own process; peak delta = that minus the "
               "memory allocated once the model and the data were on the device (after a tiny warm-up model); "
               "peak live = peak delta (the caching allocator's count is already of live tensors)")
    else:
        how = ("peak = peak RSS (VmHWM) of the variant's own fresh process (one process per variant: RSS "
               "is not shared); peak delta = that minus the RSS once the model and the data were built, after "
               "a tiny model of the same variant trained first (torch runtime and first-use allocations excluded): "
               "activations, gradients, optimizer state, master weights, temporaries, allocator slack; peak live = "
               "the peak of the CPU tensor bytes allocated after the model and the data, alive at once, from "
               "torch.profiler's allocation events in a second run of the same updates (no allocator slack)")
    info = {"config": asdict(cfg), "num_params": memory[E2E_BASELINE]["num_params"],
            "tokens_per_update": cfg.tokens_per_update, "memory": how,
            "state": ("bytes of gradients + optimizer state + master weights + flat buffers at the end of a "
                      "window's last backward, distinct storages, model params excluded (exact count)")}
    return rows, info


E2E_COLUMNS = [("key", "variant", "s"), ("ms", "ms/update", ",.1f"), ("tokens_per_s", "tokens/s", ",.0f"),
               ("ratio_text", "vs plain [p25-p75]", "s")]
"""Columns of the end-to-end throughput table; the variants' full labels follow the tables as a legend."""
E2E_MEMORY_COLUMNS = [("key", "variant", "s"), ("peak_mib", "peak MiB", ",.1f"),
                      ("peak_delta_mib", "peak delta MiB", ",.1f"), ("peak_live_mib", "peak live MiB", ",.1f"),
                      ("state_mib", "state MiB", ",.2f"), ("state_bytes_per_param", "state B/param", ".1f")]
"""Columns of the end-to-end memory table (the same variants, each in a fresh process)."""


def print_tables(rows: Sequence[dict], info: dict) -> None:
    """The end-to-end throughput and memory tables, the variants' labels, and what each column means."""
    c = info["config"]
    print_table(display_rows(rows), E2E_COLUMNS,
                f"e2e: {info['num_params']:,}-parameter GPT in {c['dtype']} ({c['n_layers']} layers, d_model {c['d_model']}), "
                f"{c['micro_batch_size']} x {c['seq_len']} tokens x K={c['accumulation_steps']} = "
                f"{info['tokens_per_update']:,} tokens per update on {c['device']}")
    print_table(rows, E2E_MEMORY_COLUMNS, "e2e memory: the same variants, each in a fresh process")
    for r in rows:
        print_note(f"  {r['key']}: {r['variant']}", indent="      ")
    print_note(f"e2e: {c['timed_updates']} timed rounds after {c['warmup_updates']}, one update of every variant per "
               "round; ms/update = median; tokens/s = tokens per update / that median; vs plain = median per-round "
               f"ratio of the plain recipe's (b) update time to the variant's, > 1: faster. {RATIO_NOTE}.")
    print_note(f"e2e memory: {info['memory']}. state = {info['state']}; state B/param = state / parameters.")
