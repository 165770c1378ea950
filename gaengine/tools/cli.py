"""Command line: ``gaengine train``, ``gaengine bench``, ``gaengine verify`` and ``gaengine info``.

``main(argv)`` parses, runs and prints; the loops live in :mod:`gaengine.tools.train` and write nothing. All
console output and every file the job writes go through :class:`_Reporter`, the one place a multi-rank
run will gate on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import gaengine
from gaengine import backends
from gaengine.config import AccumulatorConfig, field_help
from gaengine.tools import WIDTH, bench, fill
from gaengine.tools.capability import DtypeChoice, bf16_matmul_slowdown, choose_param_dtype, cpu_capability
from gaengine.tools.data import load_corpus, sample_batch
from gaengine.tools.train import (SCHEDULE_FORMS, TrainConfig, accumulation_schedule, build_model, choose_threads,
                                  parse_accumulation_schedule, train_gaengine, train_reference)
from gaengine.verify import verify_equivalence

__all__ = ["main", "build_parser"]

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default (a switch's as ``on``/``off``), except where the default is
    ``None`` (the help says what happens then)."""

    def _get_help_string(self, action):
        if isinstance(action, argparse.BooleanOptionalAction):
            text = (action.help or "").replace(" (default: %(default)s)", "")  # Python < 3.13 appends it itself
            return f"{text} (default: {'on' if action.default else 'off'})"
        return action.help if action.default is None else super()._get_help_string(action)


class _UsageError(Exception):
    """A bad combination of arguments found after parsing; reported like an argparse error (status 2)."""


def _torchrun_rank() -> Optional[int]:
    """This process's rank when a launcher started several (torchrun sets ``RANK`` and ``WORLD_SIZE`` > 1), else
    ``None``: read from the environment, so it is known before argument parsing and any process group."""
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    return rank if world > 1 else None


def _refuse(command: str, message: str, status: int) -> int:
    """Report a refusal (a usage error, a configuration the engine rejects) on stderr, one line, no traceback, and
    return ``status``. Under torchrun the line names the rank, ``gaengine train: rank 1: <message>``, and goes to
    torchrun's error file too (``TORCHELASTIC_ERROR_FILE``, which the launcher sets for each rank), so that the
    ``ChildFailedError`` report torchrun prints after the ranks exit names it as the root cause instead of a link
    to its documentation. Alone: ``gaengine train: error: <message>``."""
    rank = _torchrun_rank()
    line = f"{command}: {'error' if rank is None else f'rank {rank}'}: {message}"
    sys.stderr.write(line + "\n")  # one write: the ranks' lines do not interleave (torchrun runs python -u)
    sys.stderr.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if rank is not None else None
    if error_file:
        # The layout torch.distributed.elastic's @record writes (ErrorHandler.record_exception), with the line in
        # place of the traceback: the launcher's report prints "traceback : <the line>" for the rank.
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                             "timestamp": str(int(time.time()))}}}
        try:
            Path(error_file).write_text(json.dumps(record))
        except OSError:
            pass  # the line above is the report; torchrun's is only the better for the file
    return status


class _ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors under torchrun are one line naming the rank (:func:`_refuse`) instead of
    the usage text and the error from every rank; alone, argparse's usage and error as usual (status 2)."""

    def error(self, message: str):
        if _torchrun_rank() is None:
            super().error(message)
        sys.exit(_refuse(self.prog, message, 2))


def _number(kind: type, accept: Callable[[float], bool], requirement: str) -> Callable[[str], float]:
    """An argparse ``type``: ``kind(text)`` (``int`` or ``float``), finite and accepted by ``accept``; else an
    ``ArgumentTypeError`` that says what was expected (``requirement``, e.g. ``"must be >= 1"``)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not (math.isfinite(value) and accept(value)):
            raise argparse.ArgumentTypeError(f"{requirement}, got {text.strip()}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


_positive_int = _number(int, lambda v: v >= 1, "must be >= 1")
_non_negative_int = _number(int, lambda v: v >= 0, "must be >= 0")
_positive_float = _number(float, lambda v: v > 0, "must be a positive finite number")


def _threads(text: str) -> Optional[int]:
    """``--threads``: ``auto`` (``None``: :func:`gaengine.tools.train.choose_threads` decides) or a count >= 1."""
    return None if text.strip().lower() == "auto" else _positive_int(text)


def _accumulation_schedule(text: str) -> str:
    """``--accumulation-schedule``: ``rampup:...`` or ``adaptive:...`` (checked by
    :func:`gaengine.tools.train.parse_accumulation_schedule`), returned as given."""
    try:
        parse_accumulation_schedule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


_NONE_WORDS = ("0", "0.0", "none", "off")


def _optional_positive_float(text: str) -> Optional[float]:
    """A positive number, or ``0`` / ``none`` / ``off`` for None (e.g. ``--max-grad-norm``: no clipping)."""
    if text.strip().lower() in _NONE_WORDS:
        return None
    return _positive_float(text)


_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(AccumulatorConfig)}


def _add_config_option(group, name: str, default, *flags: str, dest: Optional[str] = None, more: str = "") -> None:
    """The option for field ``name`` of :class:`gaengine.AccumulatorConfig`, built from the field rather than spelled
    again: the flag is its name (``--max-grad-norm``; ``flags`` replace it), the help its docstring's first paragraph
    (then ``more``), the values it accepts from its default's type and its metadata (``choices``; ``minimum`` for an
    int; ``positive`` for a float that may be None: ``0``/``none``/``off``). ``default``: the command's own (``gaengine
    train`` trains a small model: its K and micro-batch size are ``TrainConfig``'s)."""
    f = _CONFIG_FIELDS[name]
    summary = field_help(name)
    if summary.split()[0][1:].islower():  # "Keep fp32 ..." -> "keep fp32 ...", argparse's style; "K, ..." stays
        summary = summary[0].lower() + summary[1:]
    options: dict = {"default": default, "dest": dest or name, "help": summary.rstrip(".") + more}
    if "choices" in f.metadata:
        options.update(choices=f.metadata["choices"], type=type(f.metadata["choices"][0]))
    elif isinstance(f.default, bool):
        options["action"] = argparse.BooleanOptionalAction
    elif "minimum" in f.metadata:
        options["type"] = _number(int, lambda v, m=f.metadata["minimum"]: v >= m, f"must be >= {f.metadata['minimum']}")
    elif f.metadata.get("positive"):
        options["type"] = _optional_positive_float
        options["help"] += f" ({'/'.join(_NONE_WORDS[:1] + _NONE_WORDS[2:])} on the command line)"
    else:  # pragma: no cover - a field no command exposes yet
        raise TypeError(f"no command-line form for AccumulatorConfig.{name}")
    group.add_argument(*(flags or ("--" + name.replace("_", "-"),)), **options)


def _add_train_data_group(p: argparse.ArgumentParser) -> None:
    """The data options: the corpus and how much of it is read."""
    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path, default=None,
                   help="a text file, or a folder read recursively (*.txt, *.py, *.md, ...); default: the stdlib")
    g.add_argument("--max-data-mb", type=_positive_float, default=4.0, help="read at most this many MiB of the corpus")


def _add_train_model_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The model options: the GPT's shape and its parameter dtype."""
    g = p.add_argument_group("model")
    g.add_argument("--n-layers", type=_positive_int, default=d.n_layers, help="transformer blocks")
    g.add_argument("--d-model", type=_positive_int, default=d.d_model, help="residual width")
    g.add_argument("--n-heads", type=_positive_int, default=d.n_heads, help="attention heads")
    g.add_argument("--seq-len", type=_positive_int, default=d.seq_len, help="bytes per sequence (context length)")
    g.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="parameter dtype; auto: bf16 on a GPU that supports it and on a CPU whose bf16 matmul is not "
                        "far slower than fp32's (measured at start; AVX2-only CPUs run it 20-30x slower), else fp32")


def _add_train_optimization_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The optimization options: updates, micro-batches, K and its schedule, AdamW, clipping, the noise scale."""
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=_positive_int, default=d.steps, help="optimizer updates")
    _add_config_option(g, "micro_batch_size", d.micro_batch_size, more="; here sequences")
    _add_config_option(g, "accumulation_steps", d.accumulation_steps)
    g.add_argument("--lr", type=_positive_float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=_non_negative_int, default=d.warmup_steps, help="linear warmup updates")
    _add_config_option(g, "max_grad_norm", d.max_grad_norm)
    g.add_argument("--seed", type=int, default=d.seed, help="initialization and sampling seed")
    g.add_argument("--accumulation-schedule", type=_accumulation_schedule, default=None, metavar="SPEC",
                   help=f"K changes during training: {SCHEDULE_FORMS[0]} (Megatron's batch-size ramp-up, in sequences "
                        f"per update over all ranks, up to micro-batch size x --accumulation-steps x ranks) or "
                        f"{SCHEDULE_FORMS[1]} (K follows the measured gradient noise scale within [K_MIN, K_MAX], "
                        "changed at most every EVERY updates, starting from --accumulation-steps; K_MIN >= 2 on one "
                        "rank; linear|sqrt moves the learning rate with the effective batch); default: K fixed")
    _add_config_option(g, "measure_noise_scale", d.noise_scale, dest="noise_scale",
                       more=": the batch above which more data per update stops paying, from the norms the "
                       "accumulation computes anyway; logged to metrics.jsonl (grad_noise_scale, in sequences) and "
                       "drawn in a second panel of loss.png (short form: --noise-scale)")
    # The short form, out of the usage line: argparse cannot wrap inside one option's brackets (107 columns).
    g.add_argument("--noise-scale", action=argparse.BooleanOptionalAction, dest="noise_scale",
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _add_train_engine_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The engine and device options: backend, device, master weights, fusion, CPU threads."""
    g = p.add_argument_group("engine and device")
    _add_config_option(g, "backend", d.backend)
    g.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    _add_config_option(g, "master_weights", d.master_weights,
                       more="; --no-master-weights: AdamW updates the bf16/fp16 params in place, state in their "
                       "dtype (8 instead of 16 B/param)")
    _add_config_option(g, "gradient_accumulation_fusion", d.gradient_accumulation_fusion,
                       more=": no bf16/fp16 weight gradient, each micro-batch's dW exact to fp32 rounding; not with "
                       "--zero-stage > 0 or --fsdp (docs/fusion.md). Its CPU cost: with bf16 params about 14%% slower "
                       "training on a CPU with native bf16 (its dW is an fp32 GEMM of the widened rows where the "
                       "plain recipe runs a bf16 one); with fp32 params no slower (measured: CPU time within 1%%, 20 "
                       "updates of the default GPT, 1 thread)")
    g.add_argument("--threads", type=_threads, default="auto", metavar="N|auto",
                   help="torch CPU threads (torch.set_num_threads), set before any work. auto: half of the CPUs "
                        "this process may use, at least 1, which holds up when other processes take some of them: "
                        "on a 2-core machine with one core busy, torch's default (2 threads) trained 4-8x slower "
                        "than 1 thread (idle, 1.65x faster). Under torchrun (WORLD_SIZE > 1) or with "
                        "OMP_NUM_THREADS set: torch's count, which follows OMP_NUM_THREADS")


def _add_train_reporting_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The reporting options: evaluation, the plain-recipe comparison, output folder, progress."""
    g = p.add_argument_group("reporting")
    g.add_argument("--eval-interval", type=_non_negative_int, default=d.eval_interval,
                   help="evaluate every N updates (0: only at the end)")
    g.add_argument("--eval-batches", type=_positive_int, default=d.eval_batches, help="fixed validation batches")
    g.add_argument("--compare", action="store_true",
                   help="also train the plain PyTorch recipe (same data, init, optimizer) and compare")
    g.add_argument("--benefit", action=argparse.BooleanOptionalAction, default=True,
                   help="show what gaengine buys (one process, without --compare or --accumulation-schedule): in bf16 "
                        "(where the machine runs it fast) the plain bf16 recipe and an fp32 reference train too, and "
                        "loss.png plots each bf16 run's parameter distance from the fp32 run over the updates (3 "
                        "runs); where --dtype auto picks fp32 (no fast bf16), a line says the benefit is bf16's and "
                        "the gaengine verify check runs on the model instead (seconds)")
    g.add_argument("--out", type=Path, default=None, help="output folder; default: runs/<timestamp>")
    g.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bar")


def _add_train_robustness_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The robustness and multi-rank options: automatic micro-batch, ZeRO, FSDP2, the process group timeout."""
    g = p.add_argument_group("robustness and multi-rank")
    g.add_argument("--auto-micro-batch", action="store_true",
                   help="on an out-of-memory error, drop the window, halve the micro-batch and double the "
                        "accumulation steps (same effective batch); single process only")
    _add_config_option(g, "zero_stage", d.zero_stage,
                       more=", under torchrun: 1 costs the communication of 0 (a reduce-scatter in the last "
                       "micro-batch and an all-gather of the parameters), 2 a reduce-scatter every micro-batch")
    g.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model with FSDP2 (fully_shard on each transformer block, then on "
                        "the root); gaengine accumulates FSDP2's reduce-scattered gradient shards in fp32 "
                        "(docs/fsdp2.md). Not with --zero-stage > 0")
    g.add_argument("--dist-timeout", type=_positive_float, default=600.0,
                   help="under torchrun: seconds a rank waits for the others before failing (process group timeout)")


def _add_train_parser(subparsers) -> None:
    """Add the ``train`` command, its options in six groups; defaults from ``TrainConfig``."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train a small byte-level GPT through the engine",
        description=(
            "Train a byte-level GPT through gaengine.GradientAccumulator and report loss, throughput and "
            "memory. Default corpus: the .py files of this Python's standard library."
        ),
        formatter_class=_HelpFormatter,
    )
    _add_train_data_group(p)
    _add_train_model_group(p, d)
    _add_train_optimization_group(p, d)
    _add_train_engine_group(p, d)
    _add_train_reporting_group(p, d)
    _add_train_robustness_group(p, d)
    p.set_defaults(func=_cmd_train)


def _add_verify_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check that accumulation over micro-batches equals the large batch on the built-in GPT",
        description="Split one batch into micro-batches and check two things per parameter "
                    "(gaengine.verify_equivalence): the engine's gradient against the micro-batch gradients summed "
                    "in fp64, within a bound derived from the dtype's rounding (u = 2^-8 bf16, 2^-11 fp16, 2^-24 "
                    "fp32); and that sum against the whole batch's gradient, within rtol 1e-5 (fp32), 2^-3 (bf16) "
                    "or 2^-6 (fp16). Prints the verdict with its reason, the bounds, a per-parameter table (each "
                    "difference as a ratio to its bound: ok up to 1) and a legend; exit status 1 when a check fails.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--batch-size", type=_positive_int, default=16, help="sequences in the whole batch")
    p.add_argument("--accumulation-steps", type=_positive_int, default=4, help="micro-batches it is split into")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="bytes per sequence")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32",
                   help="parameter dtype; the engine is checked to its rounding in each. fp32 (train's is bf16) "
                        "for the sharpest whole-batch comparison: in bf16 and fp16 the two sides round every "
                        "activation and gradient on their own (the embedding's gradients land up to 14 unit "
                        "roundoffs apart on this GPT)")
    _add_config_option(p, "backend", AccumulatorConfig.backend)
    _add_config_option(p, "gradient_accumulation_fusion", AccumulatorConfig.gradient_accumulation_fusion,
                       more=": the engine's Linear layers write each micro-batch's dW into fp32 (docs/fusion.md); "
                       "their terms are then taken from each layer's input and output gradient, summed in fp64")
    p.add_argument("--seed", type=int, default=0, help="initialization and data seed")
    p.add_argument("--data", type=Path, default=None, help="text file or folder; default: the standard library")
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    import torch

    try:
        config = TrainConfig(seq_len=args.seq_len, dtype=args.dtype, seed=args.seed, backend=args.backend)
        corpus = load_corpus(args.data, max_bytes=2**20, min_split_bytes=args.seq_len + 1)
    except (ValueError, FileNotFoundError) as e:
        raise _UsageError(str(e)) from None
    if args.accumulation_steps > args.batch_size:
        raise _UsageError(f"--accumulation-steps ({args.accumulation_steps}) exceeds --batch-size ({args.batch_size})")
    model = build_model(config)
    batch = sample_batch(corpus.train, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
    try:
        report = verify_equivalence(model, lambda m, b: m(*b), batch, args.accumulation_steps, backend=args.backend,
                                    gradient_accumulation_fusion=args.gradient_accumulation_fusion)
    except ValueError as e:  # the accumulator's refusal of an option combination (e.g. fusion without gaengine._C)
        raise _UsageError(str(e)) from None
    fused = ", gradient accumulation fusion" if args.gradient_accumulation_fusion else ""
    print(fill(f"gaengine verify: {model.num_params():,}-parameter byte-level GPT ({args.dtype}{fused}), batch of "
               f"{args.batch_size} x {args.seq_len} bytes vs {args.accumulation_steps} micro-batches"))
    print(report)  # the verdict and its reason, both comparisons' bounds, the per-parameter table
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``gaengine`` argument parser, one subparser per command."""
    parser = _ArgumentParser(prog="gaengine", description="gaengine: gradient accumulation engine for PyTorch")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train_parser(subparsers)
    bench.add_parser(subparsers)
    _add_verify_parser(subparsers)
    p = subparsers.add_parser(
        "info", help="what this install has: gaengine._C, its CPU ops and CUDA kernels, the hooks, triton",
        description="Report what was built and what loads: gaengine._C and where it is, its CPU ops and CUDA "
                    "kernels (the cpu and cuda backends), the hooks a GradientAccumulator gets (native C++ or "
                    "Python) and the backend 'auto' picks, and whether triton imports. Exit status 0 either way.")
    p.set_defaults(func=_cmd_info)
    return parser


def _probe(fn: Callable[[], str]) -> str:
    """``fn()``, or ``no (<the first line of the reason>)`` when it raises."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any failure is the answer to report
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"no ({reason})"


def build_report() -> list[tuple[str, str]]:
    """``(item, finding)`` rows of ``gaengine info``: what this install built and what loads in this process."""
    import importlib

    import torch

    def extension() -> str:
        module = importlib.import_module("gaengine._C")
        return f"yes, {module.__file__}"

    def backend(name: str, device: str) -> str:
        return f"yes (backend {backends.get_backend(name, device).name!r} loads)"

    def cuda_kernels() -> str:
        if not torch.version.cuda:
            return "no (torch is a CPU-only build)"
        why = backends.cuda_kernels_unusable()
        return "yes (backend 'cuda' loads)" if why is None else f"no ({why.splitlines()[0]})"

    def hooks(device: str) -> str:
        model = torch.nn.Linear(4, 4, device=device)
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2)
        try:
            kind = type(acc.hooks).__name__
            native = getattr(acc.hooks, "native", kind.startswith("Native"))
            return f"{'native C++' if native else 'Python'} hooks ({kind}), backend 'auto' -> {acc.backend.name!r}"
        finally:
            acc.close()

    def triton() -> str:
        module = importlib.import_module("triton")
        cuda = "CUDA tensors" + ("" if torch.cuda.is_available() else ", none visible")
        return f"yes, {module.__version__} (backend 'triton': {cuda}; CPU tensors under TRITON_INTERPRET=1)"

    cuda = f"CUDA {torch.version.cuda}" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else
                                            ", no GPU visible") if torch.version.cuda else "CPU build"
    rows = [
        ("gaengine", f"{gaengine.__version__}, {os.path.dirname(gaengine.__file__)}"),
        ("torch", f"{torch.__version__} ({cuda}), {torch.get_num_threads()} threads"),
        ("CPU", _probe(lambda: f"{cpu_capability()}; bf16 matmul {bf16_matmul_slowdown():.1f}x the time of fp32")),
        ("train dtype", _probe(lambda: choose_param_dtype("cuda" if torch.cuda.is_available() else "cpu").reason)),
        ("gaengine._C", _probe(extension)),
        ("  CPU ops", _probe(lambda: backend("cpu", "cpu"))),
        ("  CUDA kernels", _probe(cuda_kernels)),
        ("hooks on CPU", _probe(lambda: hooks("cpu"))),
    ]
    if torch.cuda.is_available():
        rows.append(("hooks on CUDA", _probe(lambda: hooks("cuda"))))
    rows.append(("triton", _probe(triton)))
    return rows


def _cmd_info(args: argparse.Namespace) -> int:
    rows = build_report()
    width = max(len(item) for item, _ in rows)
    for item, finding in rows:  # a long finding wraps under itself
        print(fill(f"{item.ljust(width)}  {finding}", " " * (width + 2)))
    return 0


class _Reporter:
    """Every line printed and every file written by a command; the single point to gate on rank 0."""

    def __init__(self, out_dir: Path, quiet: bool, enabled: bool = True) -> None:
        self.out_dir = out_dir
        self.quiet = quiet or not enabled
        self.enabled = enabled  # False on every rank but 0: nothing printed, nothing written
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(out_dir / "metrics.jsonl", "w") if enabled else None
        self._bar = None
        self._lines = None  # off a terminal: the progress lines' state (start_run)

    def print(self, text: str = "") -> None:
        if self.enabled:
            print(text, flush=True)

    LINES = 10
    """Off a terminal (output to a file or a pipe), the progress is this many lines per run, one every tenth of
    the updates, instead of a bar redrawn in place (``\r``: one line of every redraw in a file)."""

    def start_run(self, recipe: str, total: int) -> None:
        """The progress of one run of ``total`` updates, on stderr: tqdm's bar on a terminal; elsewhere
        :attr:`LINES` lines, each tqdm's own status line (``format_meter``) as the bar would show it."""
        from tqdm import tqdm

        self._lines = None
        if not self.quiet and not sys.stderr.isatty():
            self._lines = {"recipe": recipe, "total": total, "start": time.monotonic(), "postfix": "",
                           "every": max(1, math.ceil(total / self.LINES))}
            return
        self._bar = tqdm(total=total, desc=recipe, unit="upd", disable=self.quiet, file=sys.stderr, dynamic_ncols=True)

    def _progress_line(self, record: dict) -> None:
        """Off a terminal: after update ``record['step']``, a status line every ``every`` updates and at the last."""
        from tqdm import tqdm

        state = self._lines
        step = record["step"]
        if step % state["every"] and step != state["total"]:
            return
        line = tqdm.format_meter(step, state["total"], time.monotonic() - state["start"], ncols=WIDTH,
                                 prefix=state["recipe"], unit="upd",
                                 postfix=f"loss={record['loss']:.3f}, tok_s={record['tokens_per_s']:,.0f}")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if record["kind"] == "oom":
            message = (f"  out of memory: window dropped; micro-batch {record['previous'][0]} -> "
                       f"{record['micro_batch_size']}, accumulation steps {record['previous'][1]} -> "
                       f"{record['accumulation_steps']} (effective batch {record['effective_batch_size']})")
            (self._bar.write if self._bar is not None else print)(fill(message, "    "))
            return
        if self._bar is None:
            if self._lines is None:
                return
            if record["kind"] == "train":
                self._progress_line(record)
            elif record["kind"] == "eval":
                print(f"  [{record['recipe']}] update {record['step']}: val loss {record['val_loss']:.4f}", flush=True)
            return
        if record["kind"] == "train":
            self._bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            self._bar.update(1)
        elif record["kind"] == "eval":
            self._bar.write(f"  [{record['recipe']}] update {record['step']}: val loss {record['val_loss']:.4f}")

    def end_run(self) -> None:
        self._lines = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self.end_run()
        if self._metrics is not None:
            self._metrics.close()

    def plot(self, results) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator

        colors = ("tab:blue", "tab:orange", "tab:gray")
        batch_panel = any(r.noise_scales or len(set(r.effective_batches)) > 1 for r in results)
        if any(r.distances for r in results):  # the bf16 benefit: the distances above, the losses below
            batch_panel = False
            fig, (top, ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
            for r, color in zip(results, colors):
                if r.distances:
                    xs, ys = zip(*r.distances)
                    top.plot(xs, ys, "o-", color=color, ms=3, lw=1.5, label=f"{r.recipe}, bf16 (last {ys[-1]:.2e})")
            top.set_yscale("log")
            top.set_ylabel("distance from the fp32 run\n||p - p_fp32|| / ||p_fp32||")
            top.set_title("bf16 parameters' drift from the fp32 reference run (lower: closer to fp32)")
            top.grid(alpha=0.3, which="both")
            top.legend()
        elif batch_panel:  # a second panel: the noise scale and the effective batch, per update
            fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
        else:
            fig, ax = plt.subplots(figsize=(8, 4.5))
        for r, color in zip(results, colors):
            steps = range(1, len(r.train_losses) + 1)
            ax.plot(steps, r.train_losses, color=color, lw=1, alpha=0.8, label=f"{r.recipe} train")
            if r.evals:
                xs, ys = zip(*r.evals)
                ax.plot(xs, ys, "o--", color=color, ms=5, label=f"{r.recipe} validation")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer update")
        ax.set_ylabel("loss (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend()
        if batch_panel:
            ax.set_xlabel("")
            for r, color in zip(results, colors):
                steps = range(1, len(r.effective_batches) + 1)
                ax2.step(steps, r.effective_batches, where="mid", color=color, lw=1.5, label=f"{r.recipe} effective batch")
                if r.noise_scales:
                    ax2.plot(range(1, len(r.noise_scales) + 1), r.noise_scales, "--", color="tab:green", lw=1,
                             label=f"{r.recipe} noise scale B_simple")
            ax2.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax2.yaxis.set_major_formatter(plain)
            ax2.yaxis.set_minor_formatter(plain)
            ax2.set_xlabel("optimizer update")
            ax2.set_ylabel("sequences per update")
            ax2.grid(alpha=0.3, which="both")
            ax2.legend()
        fig.tight_layout()
        path = self.out_dir / "loss.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


_MODES = {
    "replicated": "the whole model state on every rank; gradients all-reduced",
    "ZeRO-1": "masters and optimizer state sharded over the ranks",
    "ZeRO-2": "gradient sum, masters and optimizer state sharded over the ranks",
    "FSDP2": "parameters, gradients and optimizer state sharded over the ranks",
}


def _mode(config, world: int) -> str:
    """The summary's ``mode:`` line: how the run was spread over ``world`` processes (replicated, ZeRO-1, ZeRO-2
    or FSDP2: docs/sharding.md, docs/fsdp2.md) and what each rank holds."""
    if world == 1:
        return ("mode: one process (1 rank), nothing sharded or all-reduced" if not config.zero_stage else
                f"mode: one process (1 rank), nothing sharded (--zero-stage {config.zero_stage} shards under torchrun)")
    name = "FSDP2" if config.fsdp else (f"ZeRO-{config.zero_stage}" if config.zero_stage else "replicated")
    return f"mode: {name} over {world} ranks ({_MODES[name]})"


def _summary(results, config, corpus, world: int = 1, threads: str = "") -> str:
    """The end-of-run table: one column per recipe, plus the gap when there are two."""
    rows = [
        ("updates", lambda r: f"{r.updates}" + (f" ({r.skipped_updates} skipped)" if r.skipped_updates else "")),
        ("tokens", lambda r: f"{r.tokens:,}"),
        ("wall time", lambda r: f"{r.wall_s:.1f} s"),
        ("tokens/s (train)", lambda r: f"{r.tokens_per_s:,.0f}"),
        ("first train loss", lambda r: f"{r.train_losses[0]:.4f}"),
        ("final train loss", lambda r: f"{r.final_train_loss:.4f}"),
        ("validation loss", lambda r: f"{r.val_loss:.4f}"),
        ("grad norm min/max", lambda r: f"{min(r.grad_norms):.3g} / {max(r.grad_norms):.3g}"),
        ("final effective batch",
         lambda r: f"{r.final_effective_batch} seq ({r.final_effective_batch * config.seq_len:,} tok)"),
        ("peak memory", lambda r: f"{_fmt_bytes(r.peak_memory_bytes)}"),
    ]
    if any(r.noise_scales for r in results):
        rows.append(("final noise scale", lambda r: f"{r.noise_scales[-1]:,.1f} seq" if r.noise_scales else "-"))
    if any(r.distances for r in results):
        rows.append(("distance from fp32, last", lambda r: f"{r.distances[-1][1]:.3e}" if r.distances else "-"))
        rows.append(("distance from fp32, mean",
                     lambda r: f"{sum(d for _, d in r.distances) / len(r.distances):.3e}" if r.distances else "-"))
    names = [r.recipe for r in results]
    table = [[label] + [fn(r) for r in results] for label, fn in rows]
    if len(results) == 2:
        a, b = results
        names.append("gap (gaengine - torch)")
        for row in table:
            row.append("")
        table[5][-1] = f"{a.final_train_loss - b.final_train_loss:+.4f}"
        table[6][-1] = f"{a.val_loss - b.val_loss:+.4f}"
    header = ["", *names]
    widths = [max(len(row[i]) for row in [header] + table) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    # Within gaengine.tools.WIDTH columns: the sentences wrap; the table (a label, two or three short figures) fits.
    out = [
        fill(f"model: {results[0].num_params:,} params, {config.n_layers} layers, d_model {config.d_model}, "
             f"{config.n_heads} heads, context {config.seq_len}, {config.dtype} params on {config.device}"
             + (", sharded with FSDP2 (fully_shard per block + root)" if config.fsdp else "")),
        fill(f"batch: {config.micro_batch_size} x {config.seq_len} bytes per micro-batch, K={config.accumulation_steps}"
             + (f" then {config.accumulation_schedule}" if config.accumulation_schedule else "") + ", "
             f"{world} rank(s), {config.tokens_per_update * world:,} tokens per update"),
        fill(_mode(config, world)),
        *([fill("gradient accumulation fusion: on (each Linear's weight gradient computed straight into fp32 "
                "main_grad, no bf16/fp16 weight gradient)")] if config.gradient_accumulation_fusion else []),
        fill(f"optimizer: AdamW, lr {config.lr:g}, max_grad_norm {config.max_grad_norm}"
             + (f"; torch threads {threads}" if threads else "")),
        fill(f"data: {corpus.source}: {corpus.num_files} files, {corpus.train.numel():,} train / "
             f"{corpus.val.numel():,} validation bytes"),
        "",
        line(header),
        line(["-" * w for w in widths]),
        *(line(row) for row in table),
        fill("(final train loss: mean window loss over the last 10% of updates; peak memory: "
             f"{results[0].peak_memory_kind}"
             + (", cumulative over the runs of this process" if len(results) > 1 and config.device == "cpu" else "")
             + (f"; distance from fp32: ||p - p_fp32|| / ||p_fp32|| over all parameters at the same update"
                if any(r.distances for r in results) else "")
             + ")", " "),
    ]
    return "\n".join(out)


def _cmd_train(args: argparse.Namespace) -> int:
    """``gaengine train``: torch's CPU thread count is set before any work and restored at the end."""
    import torch

    threads, why = choose_threads(args.threads)
    previous = torch.get_num_threads()
    # Intra-op threads only: eager training runs no inter-op work (torch.jit.fork), so the inter-op pool is
    # left alone (it can be sized only before its first use in the process).
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(args, f"{torch.get_num_threads()} ({why})")
    finally:
        torch.set_num_threads(previous)


def _train(args: argparse.Namespace, threads: str) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda but no CUDA device is available")
    dtype = choose_param_dtype(device) if args.dtype == "auto" else DtypeChoice(args.dtype, f"{args.dtype} params "
                                                                                          "(--dtype)")
    try:
        config = TrainConfig(
            steps=args.steps,
            micro_batch_size=args.micro_batch_size,
            accumulation_steps=args.accumulation_steps,
            seq_len=args.seq_len,
            n_layers=args.n_layers,
            d_model=args.d_model,
            n_heads=args.n_heads,
            dtype=dtype.dtype,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            max_grad_norm=args.max_grad_norm,
            device=device,
            backend=args.backend,
            master_weights=args.master_weights,
            gradient_accumulation_fusion=args.gradient_accumulation_fusion,
            zero_stage=args.zero_stage,
            seed=args.seed,
            eval_interval=args.eval_interval,
            eval_batches=args.eval_batches,
            auto_micro_batch=args.auto_micro_batch,
            noise_scale=args.noise_scale,
            accumulation_schedule=args.accumulation_schedule,
            fsdp=args.fsdp,
        )
        corpus = load_corpus(args.data, max_bytes=int(args.max_data_mb * 2**20), min_split_bytes=args.seq_len + 1)
    except (ValueError, FileNotFoundError) as e:
        raise _UsageError(str(e)) from None

    rank, world = _init_distributed(device, args.dist_timeout)
    try:
        try:
            _check_ranks(args, config, world)
        except _UsageError as e:
            if world == 1:
                raise
            # These refusals read only the arguments and the world size, so every rank makes the same one: each
            # prints its line, then waits for the others to have printed theirs before it exits (torchrun stops
            # the ranks still running as soon as one exits).
            import torch.distributed as dist

            _refuse("gaengine train", str(e), 2)
            dist.barrier()
            sys.exit(2)
        _run(args, config, corpus, dtype, rank, world, threads)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _check_ranks(args: argparse.Namespace, config: TrainConfig, world: int) -> None:
    """The refusals that depend on the number of ranks (``world``), made once the process group is up."""
    if args.compare and config.accumulation_schedule is not None:
        raise _UsageError("--compare trains the plain recipe at a fixed K; run it without --accumulation-schedule")
    try:
        accumulation_schedule(config, world)  # the ramp must fit micro-batch size x ranks
    except ValueError as e:
        raise _UsageError(f"--accumulation-schedule: {e}") from None
    if args.fsdp and world == 1:
        raise _UsageError("--fsdp shards the model over the ranks of torchrun: run it as torchrun --nproc-per-node N "
                          "-m gaengine train --fsdp (N >= 2)")
    if world > 1 and args.compare:
        raise _UsageError("--compare runs the single-process plain recipe; run it without torchrun")
    if world > 1 and args.auto_micro_batch:
        raise _UsageError("--auto-micro-batch is single-process only (an out-of-memory error on one rank "
                          "would leave the others waiting in the all-reduce)")


def _run(args: argparse.Namespace, config: TrainConfig, corpus, dtype: DtypeChoice, rank: int, world: int,
         threads: str) -> None:
    """Train (the engine, then with --compare the plain recipe), print the summary and write the outputs."""
    import torch

    out_dir = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    reporter = _Reporter(out_dir, args.quiet, enabled=rank == 0)
    reporter.print(fill(f"gaengine train: {dtype.reason}"))
    try:
        if reporter.enabled:
            record = {**dataclasses.asdict(config), "data": corpus.source, "torch_threads": torch.get_num_threads()}
            (out_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
        benefit = _benefit(args, config, dtype, world)
        if benefit == "bf16":
            results = _train_bf16_benefit(config, corpus, reporter)
        else:
            results = []
            recipes = [train_gaengine] + ([train_reference] if args.compare else [])
            for recipe in recipes:
                reporter.start_run(recipe.__name__.removeprefix("train_").replace("reference", "torch"), config.steps)
                results.append(recipe(config, corpus, log=reporter.log))
                reporter.end_run()
        if reporter.enabled:
            plot = reporter.plot(results)
            reporter.print(_summary(results, config, corpus, world, threads))
            if benefit == "bf16":
                reporter.print(fill(_bf16_benefit_line(results)))
            elif benefit == "fp32":
                reporter.print(_fp32_benefit(config, corpus, dtype))
            reporter.print(fill(f"wrote {out_dir / 'metrics.jsonl'}, {plot}"))
    finally:
        reporter.close()


BENEFIT_POINTS = 30
"""How many updates of the bf16 benefit's runs are compared with the fp32 reference (evenly spaced, the last
included): each keeps one fp32 copy of the reference's parameters (4 B/param; 100 MiB for the default GPT)."""


def _benefit(args: argparse.Namespace, config: TrainConfig, dtype: DtypeChoice, world: int) -> Optional[str]:
    """Which benefit ``gaengine train`` shows (``--benefit``): ``"bf16"`` when the run is bf16 (``--dtype auto``
    picked it: the machine runs bf16 fast, or it was asked for), ``"fp32"`` when ``--dtype auto`` picked fp32 (the
    machine has no fast bf16), None otherwise: ``--no-benefit``, ``--compare`` (its own comparison), several ranks,
    an accumulation schedule or ``--auto-micro-batch`` (the plain recipe has neither), or fp16 / a forced fp32."""
    if (not args.benefit or args.compare or world > 1 or config.accumulation_schedule is not None
            or config.auto_micro_batch or config.fsdp):
        return None
    if dtype.dtype == "bf16":
        return "bf16"
    return "fp32" if args.dtype == "auto" and dtype.dtype == "fp32" else None


def _flat_params(model) -> "torch.Tensor":
    import torch

    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _train_bf16_benefit(config: TrainConfig, corpus, reporter: "_Reporter") -> list:
    """The bf16 benefit: the plain recipe in fp32 first (the reference: same data, initialization and optimizer),
    keeping its parameters at :data:`BENEFIT_POINTS` updates; then the bf16 model through gaengine and through the
    plain bf16 recipe, each run's ``distances`` measured from the reference's parameters at those updates. Returns
    ``[gaengine, torch, fp32 reference]``."""
    every = max(1, config.steps // BENEFIT_POINTS)
    marks = set(range(every, config.steps + 1, every)) | {config.steps}
    reference_params = {}

    def keep(step, model):
        if step in marks:
            reference_params[step] = _flat_params(model)

    def measure(distances):
        def watch(step, model):
            if step in marks:
                ref = reference_params[step]
                distances.append((step, float((_flat_params(model) - ref).norm() / ref.norm())))
        return watch

    reporter.start_run("fp32 reference", config.steps)
    reference = train_reference(dataclasses.replace(config, dtype="fp32"), corpus, log=reporter.log, watch=keep,
                                recipe="fp32 reference")
    reporter.end_run()
    results = []
    for name, recipe in (("gaengine", train_gaengine), ("torch", train_reference)):
        distances = []
        reporter.start_run(name, config.steps)
        result = recipe(config, corpus, log=reporter.log, watch=measure(distances))
        reporter.end_run()
        result.distances = distances
        results.append(result)
    return results + [reference]


def _bf16_benefit_line(results) -> str:
    """The bf16 benefit's verdict: how much closer to the fp32 run gaengine's bf16 parameters end than the plain
    bf16 recipe's."""
    engine, plain = results[0].distances[-1][1], results[1].distances[-1][1]
    ratio = plain / engine if engine > 0 else float("inf")
    return (f"bf16 benefit: after {results[0].updates} updates gaengine's bf16 parameters are {engine:.3e} from the "
            f"fp32 run's, the plain bf16 recipe's {plain:.3e}: {ratio:.1f}x closer (gaengine sums each window's "
            "gradients in fp32 and updates fp32 master weights; the plain recipe sums them in bf16 .grad and "
            "updates the bf16 parameters). loss.png plots both distances over the updates")


def _fp32_benefit(config: TrainConfig, corpus, dtype: DtypeChoice) -> str:
    """On a machine without fast bf16: the line saying the benefit is bf16's, then ``gaengine verify``'s summary on
    this run's model (fp32, the run's K, ``K x min(micro-batch, 4)`` rows of the run's context)."""
    import torch

    rows = config.accumulation_steps * min(config.micro_batch_size, 4)
    model = build_model(dataclasses.replace(config, dtype="fp32"))
    batch = sample_batch(corpus.train, rows, config.seq_len, torch.Generator().manual_seed(config.seed))
    report = verify_equivalence(model, lambda m, b: m(*b), batch, config.accumulation_steps, backend=config.backend)
    head = fill(f"bf16 benefit: not shown here, this machine runs fp32 only: {dtype.reason.split(': ', 1)[-1]}. "
                "What gaengine buys is bf16's: the plain bf16 recipe sums each window's gradients in bf16 and drifts "
                "further from an fp32 run than gaengine's fp32 sums and master weights do (on a machine with fast "
                "bf16, gaengine train plots both distances). In fp32 both recipes train alike; what holds here is "
                f"the equivalence, checked on this model (gaengine verify, {rows} rows as "
                f"{config.accumulation_steps} micro-batches):")
    return head + "\n" + "\n".join("  " + line for line in report.summary().splitlines())


def _init_distributed(device: str, timeout_s: float) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on CUDA, gloo on CPU); returns (rank, world)."""
    import datetime

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``gaengine`` console script; returns the exit status.

    Usage errors exit with status 2 (argparse's convention, raised as ``SystemExit``); a configuration the
    engine rejects returns 1 after printing its ``ValueError`` message. Either is one line on stderr, no
    traceback: ``gaengine train: error: <message>``, or under torchrun, from each rank that refuses,
    ``gaengine train: rank N: <message>`` (:func:`_refuse`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    command = f"gaengine {args.command}"
    try:
        return args.func(args)
    except _UsageError as e:
        sys.exit(_refuse(command, str(e), 2))
    except ValueError as e:
        # A configuration error raised by the engine (e.g. accumulation_steps=0): the message, no traceback.
        return _refuse(command, str(e), 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
