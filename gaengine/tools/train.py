"""Training loops of ``gaengine train``: the byte-level GPT trained through the engine, or the plain recipe.

Two loops over the same micro-batches, the same initialization and the same optimizer configuration:

* :func:`train_gaengine` — ``acc.backward(loss)`` per micro-batch and ``acc.step()`` at the end of each
  accumulation window (fp32 main_grad accumulation, fp32 master weights, clip coefficient on device); with
  ``fsdp`` the model is sharded with FSDP2 first (:func:`shard_model`).
  With ``noise_scale`` the accumulator also measures the gradient noise scale (``gaengine.noise``); with
  ``accumulation_schedule`` K follows a ramp-up or the measured noise scale (``gaengine.schedules``).
* :func:`train_reference` — the standard PyTorch recipe (``research/pytorch_native.md`` §3):
  ``(loss / K).backward()`` accumulating ``.grad`` in the parameter dtype, ``clip_grad_norm_``,
  ``optimizer.step()``, ``zero_grad(set_to_none=True)``.

Both return a :class:`TrainResult` and report each update and each evaluation to an optional ``log``
callback as a plain dict (the CLI turns those into the progress bar and ``metrics.jsonl``); this module
prints and writes nothing.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import torch
import torch.distributed as dist

from gaengine.config import AccumulatorConfig
from gaengine.tools.data import ByteCorpus, eval_batches, sample_batch
from gaengine.engine import GradientAccumulator
from gaengine.schedules import AccumulationSchedule, Adaptive, RampUp
from gaengine.tools.model import GPT, GPTConfig
from gaengine.utils import is_oom_error

__all__ = ["DTYPES", "ENGINE_FIELDS", "TrainConfig", "TrainResult", "accumulation_schedule", "build_model",
           "choose_threads", "evaluate", "parse_accumulation_schedule", "shard_model", "train_gaengine",
           "train_reference"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Parameter dtypes accepted by ``TrainConfig.dtype``."""

LogFn = Callable[[dict], None]
WatchFn = Callable[[int, torch.nn.Module], None]
"""Called after each update with its number (1-based) and the model, e.g. to compare its parameters with another
run's (``gaengine train``'s bf16 benefit); it must not change the model."""


SCHEDULE_FORMS = ("rampup:START,INCREMENT,RAMP_SAMPLES", "adaptive:K_MIN,K_MAX[,EVERY[,linear|sqrt]]")
"""The forms of ``TrainConfig.accumulation_schedule`` (``--accumulation-schedule``)."""


def parse_accumulation_schedule(text: str) -> tuple[str, tuple[int, ...], Optional[str]]:
    """``(kind, numbers, lr_rule)`` of an accumulation schedule, one of :data:`SCHEDULE_FORMS`.

    * ``rampup:START,INCREMENT,RAMP_SAMPLES``: Megatron's ``--rampup-batch-size`` (``gaengine.schedules.RampUp``),
      in sequences per update over all ranks, growing to ``micro_batch_size x accumulation_steps x world size``.
    * ``adaptive:K_MIN,K_MAX[,EVERY[,RULE]]``: K follows the measured gradient noise scale
      (``gaengine.schedules.Adaptive``), changing at most every ``EVERY`` updates (default 1) and starting from
      ``accumulation_steps``; ``RULE`` (``linear`` | ``sqrt``) moves the learning rate with the effective batch.

    Raises ``ValueError`` saying which form was expected and what was wrong.
    """
    kind, sep, rest = str(text).partition(":")
    fields = [f.strip() for f in rest.split(",")] if sep else []
    usage = f"expected {' or '.join(SCHEDULE_FORMS)}, got {text!r}"
    rule = None
    if kind == "adaptive" and len(fields) == 4:
        rule = fields.pop()
        if rule not in ("linear", "sqrt"):
            raise ValueError(f"the learning-rate rule of an adaptive schedule must be linear or sqrt, got {rule!r}")
    counts = {"rampup": (3,), "adaptive": (2, 3)}
    if kind not in counts or len(fields) not in counts[kind]:
        raise ValueError(usage)
    try:
        numbers = tuple(int(f) for f in fields)
    except ValueError:
        raise ValueError(f"{usage}: the numbers must be integers") from None
    if kind == "rampup":
        RampUp(start_batch_size=numbers[0], batch_size_increment=numbers[1], ramp_samples=numbers[2],
               global_batch_size=numbers[0], micro_batch_size=1)  # the fields' own checks (ValueError naming one)
    else:
        # The fields' own checks; the ranks are not known yet (k_min >= 2 on one rank: accumulation_schedule).
        Adaptive(k_min=numbers[0], k_max=numbers[1], every=numbers[2] if len(numbers) > 2 else 1, world_size=2)
    return kind, numbers, rule


def accumulation_schedule(config: "TrainConfig", world: int, optimizer: Optional[torch.optim.Optimizer] = None,
                          lr_scheduler=None):
    """The schedule ``config.accumulation_schedule`` names for ``world`` ranks (None when it names none); the
    adaptive one moves ``optimizer``'s and ``lr_scheduler``'s learning rates when it has a rule (without an
    ``optimizer`` the rule is left out: a check of the numbers). Raises ``ValueError`` when the ramp does not fit
    ``micro_batch_size x world``."""
    if config.accumulation_schedule is None:
        return None
    kind, numbers, rule = parse_accumulation_schedule(config.accumulation_schedule)
    if kind == "rampup":
        return RampUp(start_batch_size=numbers[0], batch_size_increment=numbers[1], ramp_samples=numbers[2],
                      global_batch_size=config.micro_batch_size * config.accumulation_steps * world,
                      micro_batch_size=config.micro_batch_size, world_size=world)
    return Adaptive(k_min=numbers[0], k_max=numbers[1], every=numbers[2] if len(numbers) > 2 else 1,
                    initial=config.accumulation_steps, world_size=world,
                    lr_rule=rule if optimizer is not None else None, optimizer=optimizer if rule else None,
                    lr_scheduler=lr_scheduler if rule else None)


def choose_threads(requested: Optional[int] = None, environ=None,
                   cpus: Optional[int] = None) -> tuple[Optional[int], str]:
    """The number of torch CPU threads for a run, and why: ``(None, why)`` leaves torch's own count.

    requested: ``--threads`` (``None``: not given). environ: the environment (default ``os.environ``). cpus: the
    CPUs this process may run on (default ``os.sched_getaffinity``, else ``os.cpu_count()``).

    * ``requested``, when given.
    * Under torchrun (``WORLD_SIZE`` > 1) or with ``OMP_NUM_THREADS`` set: ``None``, torch's count, which follows
      ``OMP_NUM_THREADS`` (torchrun sets it to 1 for several ranks per machine when it is unset).
    * Otherwise half of ``cpus``, at least 1 (1 on a 2-core machine). torch's default, one thread per physical
      core, falls off a cliff as soon as another process takes one of the cores: every op ends in an OpenMP
      barrier that waits for its slowest thread, and a descheduled thread is late by a whole scheduler time
      slice. Measured on a 2-core machine (docs/performance.md, "Threads"): with a busy loop on one core, the
      default ``gaengine train`` ran at 1,100-1,750 tokens/s with 2 threads and 6,700-8,900 with 1; with both cores
      idle, at 22,500-24,900 with 2 and 13,600-14,800 with 1. Half the cores gives up at most that 1.65x on an
      idle machine for the 4-8x of a busy one.
    """
    environ = os.environ if environ is None else environ
    if requested is not None:
        return requested, "--threads"
    if environ.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}"
    if int(environ.get("WORLD_SIZE", "1") or 1) > 1:
        return None, f"WORLD_SIZE={environ['WORLD_SIZE']}: torch's default"
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // 2), f"auto: half of {cpus} CPUs"


_ENGINE = AccumulatorConfig()  # the engine's defaults


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run; both recipes read the same one.

    A field named as one of :class:`gaengine.AccumulatorConfig` is that option of the accumulator (its docstring
    there is the reference, ``gaengine train --help`` shows it) and is checked there: :meth:`accumulator_config`
    passes every such field on by name, none is spelled again. ``noise_scale`` is ``measure_noise_scale``.
    """

    steps: int = 120
    """Optimizer updates (accumulation windows)."""
    micro_batch_size: int = 16
    """The accumulator's ``micro_batch_size``, in sequences (required here)."""
    accumulation_steps: int = 4
    """The accumulator's K; effective batch = ``micro_batch_size * accumulation_steps`` sequences (x ranks)."""
    seq_len: int = 128
    """Tokens (bytes) per sequence; also the model's context length."""
    n_layers: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Residual width."""
    n_heads: int = 4
    """Attention heads."""
    dtype: str = "bf16"
    """Parameter dtype: ``bf16`` | ``fp16`` | ``fp32`` (the model is cast with ``model.to(dtype)``)."""
    lr: float = 3e-3
    """Peak learning rate (after warmup)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of ``lr``."""
    warmup_steps: int = 10
    """Updates of linear warmup from ``lr / warmup_steps``."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    max_grad_norm: Optional[float] = _ENGINE.max_grad_norm
    """The accumulator's ``max_grad_norm`` (the plain recipe clips to it too)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    backend: str = _ENGINE.backend
    """The accumulator's ``backend``."""
    zero_stage: int = _ENGINE.zero_stage
    """The accumulator's ``zero_stage`` (under torchrun; one process shards nothing)."""
    master_weights: bool = _ENGINE.master_weights
    """The accumulator's ``master_weights`` (False: AdamW's state in the parameters' dtype, 8 instead of 16 B/param)."""
    gradient_accumulation_fusion: bool = _ENGINE.gradient_accumulation_fusion
    """The accumulator's ``gradient_accumulation_fusion``: each ``nn.Linear``'s weight gradient computed straight into
    fp32 main_grad (``gaengine.fusion``; the GPT's attention and MLP projections)."""
    seed: int = 0
    """Seeds the initialization and the micro-batch sampler (the same for both recipes)."""
    eval_interval: int = 50
    """Evaluate every this many updates (and after the last one); 0: only after the last one."""
    eval_batches: int = 8
    """Validation batches of ``micro_batch_size`` sequences, fixed for the whole run."""
    auto_micro_batch: bool = False
    """On an out-of-memory error mid-window: drop the window (``acc.zero_grad()``), halve the micro-batch,
    double the accumulation steps (same effective batch) and go on. Single process only."""
    noise_scale: bool = _ENGINE.measure_noise_scale
    """The accumulator's ``measure_noise_scale`` (gaengine only; an ``adaptive`` schedule turns it on)."""
    fsdp: bool = False
    """Shard the model with FSDP2 (``torch.distributed.fsdp.fully_shard``, :func:`shard_model`): each transformer
    block, then the root (embeddings, final LayerNorm, tied head), over the process group's ranks; the accumulator
    takes the FSDP2 model as it is (``gaengine.fsdp2``). Needs an initialized process group (torchrun); not with
    ``zero_stage`` > 0 (FSDP2 shards the parameters, gradients and optimizer state) or ``auto_micro_batch``."""
    accumulation_schedule: Optional[str] = None
    """K per window from a schedule, one of :data:`SCHEDULE_FORMS` (gaengine only; ``adaptive`` measures the
    noise scale); None: K = ``accumulation_steps`` throughout. With ``rampup`` the ramp ends at
    ``accumulation_steps``; with ``adaptive`` it is the first K."""

    def __post_init__(self) -> None:
        positive = ("steps", "micro_batch_size", "accumulation_steps", "seq_len", "n_layers", "d_model", "n_heads")
        for name in positive + ("eval_batches",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_interval < 0 or self.warmup_steps < 0:
            raise ValueError(f"eval_interval and warmup_steps must be >= 0, got {self.eval_interval}, {self.warmup_steps}")
        self.accumulator_config()  # the engine's options, checked where they are defined (ValueError naming one)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if self.fsdp and self.zero_stage:
            raise ValueError(f"fsdp shards the model with FSDP2, which already shards the parameters, gradients and "
                             f"optimizer state: leave zero_stage at 0 (got {self.zero_stage})")
        if self.fsdp and self.auto_micro_batch:
            raise ValueError("auto_micro_batch is single-process only and fsdp needs several ranks: use one or the "
                             "other")
        if self.accumulation_schedule is not None:
            kind, numbers, _ = parse_accumulation_schedule(self.accumulation_schedule)
            if kind == "adaptive" and not numbers[0] <= self.accumulation_steps <= numbers[1]:
                raise ValueError(f"accumulation_steps ({self.accumulation_steps}) is the adaptive schedule's first K: "
                                 f"it must lie in [K_MIN, K_MAX] = [{numbers[0]}, {numbers[1]}]")
            if self.auto_micro_batch:
                raise ValueError("auto_micro_batch doubles K after an out-of-memory error, which an accumulation "
                                 "schedule sets: use one or the other")

    @property
    def measures_noise_scale(self) -> bool:
        """Whether the gaengine run measures the noise scale (asked for, or needed by an adaptive schedule)."""
        return self.noise_scale or (self.accumulation_schedule or "").startswith("adaptive:")

    def accumulator_config(self, schedule: Optional[AccumulationSchedule] = None) -> AccumulatorConfig:
        """The accumulator's options for this run: every field named as one of ``AccumulatorConfig``'s
        (:data:`ENGINE_FIELDS`), ``measure_noise_scale`` from :attr:`measures_noise_scale`, and ``schedule`` as
        ``accumulation_steps`` when given. ``ValueError`` naming the option for a bad value."""
        options = {name: getattr(self, name) for name in ENGINE_FIELDS}
        if schedule is not None:
            options["accumulation_steps"] = schedule
        return AccumulatorConfig(**options, measure_noise_scale=self.measures_noise_scale)

    @property
    def tokens_per_update(self) -> int:
        """Tokens consumed by one update: ``micro_batch_size * accumulation_steps * seq_len``."""
        return self.micro_batch_size * self.accumulation_steps * self.seq_len

    @property
    def model_config(self) -> GPTConfig:
        """Shape of the GPT this run trains."""
        return GPTConfig(context_len=self.seq_len, n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads)


ENGINE_FIELDS = tuple(f.name for f in fields(AccumulatorConfig) if f.name in {g.name for g in fields(TrainConfig)})
"""The fields of :class:`TrainConfig` that are options of the accumulator, passed on by name."""


@dataclass
class TrainResult:
    """Outcome of one training run; losses are mean cross-entropy per byte (nats)."""

    recipe: str
    """``gaengine`` or ``torch`` (the plain recipe)."""
    num_params: int
    """Distinct model parameters."""
    updates: int = 0
    """Optimizer updates taken (including skipped ones)."""
    skipped_updates: int = 0
    """Updates skipped because of a non-finite gradient (gaengine only)."""
    tokens: int = 0
    """Training tokens consumed."""
    train_s: float = 0.0
    """Wall time of the training steps, evaluation excluded (seconds)."""
    wall_s: float = 0.0
    """Wall time of the whole run, evaluation and setup included (seconds)."""
    train_losses: list[float] = field(default_factory=list)
    """Window loss of each update."""
    grad_norms: list[float] = field(default_factory=list)
    """Gradient norm of each update (after normalization, before clipping)."""
    effective_batches: list[int] = field(default_factory=list)
    """Sequences per update over all ranks, of each update (micro-batch size x K x world size)."""
    noise_scales: list[float] = field(default_factory=list)
    """The gradient noise scale ``B_simple`` after each update, in sequences (empty when not measured)."""
    evals: list[tuple[int, float]] = field(default_factory=list)
    """``(update, validation loss)`` pairs."""
    distances: list[tuple[int, float]] = field(default_factory=list)
    """``(update, distance)``: the relative L2 distance of the model's parameters from an fp32 reference run's at the
    same update, ``||p - p_fp32|| / ||p_fp32||`` over all parameters (filled by ``gaengine train``'s bf16
    benefit; empty otherwise)."""
    peak_memory_bytes: int = 0
    """Peak memory, see ``peak_memory_kind``."""
    peak_memory_kind: str = ""
    """What ``peak_memory_bytes`` measures."""

    @property
    def tokens_per_s(self) -> float:
        """Training throughput, evaluation excluded."""
        return self.tokens / self.train_s if self.train_s > 0 else float("nan")

    @property
    def final_train_loss(self) -> float:
        """Mean window loss over the last 10% of updates (at least one)."""
        tail = self.train_losses[-max(1, len(self.train_losses) // 10) :]
        return sum(tail) / len(tail) if tail else float("nan")

    @property
    def final_effective_batch(self) -> int:
        """Sequences per update (over all ranks) of the last update, 0 before any."""
        return self.effective_batches[-1] if self.effective_batches else 0

    @property
    def val_loss(self) -> float:
        """Validation loss after the last update."""
        return self.evals[-1][1] if self.evals else float("nan")


def build_model(config: TrainConfig) -> GPT:
    """The GPT for ``config``: initialized from ``config.seed`` in fp32, then cast to ``config.dtype``.

    Both recipes call this, so they start from bitwise the same parameters.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = GPT(config.model_config)
    return model.to(device=config.device, dtype=DTYPES[config.dtype])


def shard_model(model: GPT, device: str) -> GPT:
    """Shard ``model`` in place with FSDP2 over every rank of the default process group, the usual way: one
    ``fully_shard`` per transformer block, then one on the root, which takes the parameters left (the token and
    position embeddings, the final LayerNorm and the head tied to the token embedding). Each parameter's dim 0 is
    split over the ranks (``Shard(0)`` DTensors); FSDP2 all-gathers a block before its forward and backward and
    reduce-scatters its gradient after. Returns ``model``. ``RuntimeError`` (torch's) without a process group."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - only for --fsdp
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95), fused=True
    )


def _scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps`` updates, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches) -> float:
    """Mean loss of ``model`` over ``batches`` (a list of ``(x, y)``), in eval mode; one host sync."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    for x, y in batches:
        total += model(x, y).float()
    model.train(was_training)
    return total.item() / len(batches)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (``0, 1`` without an initialized process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _peak_memory(device: str) -> tuple[int, str]:
    if device == "cuda":
        return torch.cuda.max_memory_allocated(), "CUDA max_memory_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return (peak if sys.platform == "darwin" else peak * 1024), "process peak RSS"


# One update: takes the next-micro-batch function, returns the window's micro-batches (K) and 0-d tensors keyed
# loss, grad_norm, clip_coef, skipped (and grad_noise_scale when measured, in micro-batches).
_UpdateFn = Callable[[Callable[[], tuple[torch.Tensor, torch.Tensor]]], tuple[int, dict[str, torch.Tensor]]]
# Builds a recipe's update function (and the cleanup to run after the last update) for one model.
_MakeUpdate = Callable[
    [GPT, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR], tuple[_UpdateFn, Callable[[], None]]
]


def _rank_shard(corpus: ByteCorpus, config: TrainConfig) -> tuple[torch.Tensor, int]:
    """This rank's contiguous shard of the training bytes (all of them on one rank) and the world size.

    Raises ``ValueError`` when the shard holds no sequence of ``config.seq_len`` bytes and its target.
    """
    rank, world = rank_and_world()
    n = corpus.train.numel()
    shard = corpus.train[rank * n // world:(rank + 1) * n // world] if world > 1 else corpus.train
    if shard.numel() <= config.seq_len:
        raise ValueError(f"the training data is too small for {world} ranks of seq_len {config.seq_len}")
    return shard, world


def _record_update(result: TrainResult, config: TrainConfig, step: int, k: int, world: int, lr: float,
                   values: dict[str, float], start: float) -> dict:
    """Add update ``step`` (K = ``k``, its read ``values``: loss, grad_norm, clip_coef, skipped, maybe
    grad_noise_scale) to ``result``; return its ``metrics.jsonl`` record (``start``: the run's perf_counter)."""
    loss, grad_norm, skipped = values["loss"], values["grad_norm"], values["skipped"]
    result.updates = step
    effective_batch = config.micro_batch_size * k * world
    result.tokens += effective_batch * config.seq_len
    result.effective_batches.append(effective_batch)
    result.skipped_updates += int(skipped)
    result.train_losses.append(loss)
    result.grad_norms.append(grad_norm)
    record = {"kind": "train", "recipe": result.recipe, "step": step, "loss": loss, "grad_norm": grad_norm,
              "clip_coef": values["clip_coef"], "skipped": bool(skipped), "lr": lr, "tokens": result.tokens,
              "accumulation_steps": k, "effective_batch": effective_batch,
              "elapsed_s": time.perf_counter() - start, "tokens_per_s": result.tokens_per_s}
    if "grad_noise_scale" in values:  # B_simple in micro-batches (mean mode) -> sequences
        noise_scale = values["grad_noise_scale"] * config.micro_batch_size
        result.noise_scales.append(noise_scale)
        record["grad_noise_scale"] = noise_scale if math.isfinite(noise_scale) else None
    return record


def _run(
    recipe: str,
    config: TrainConfig,
    corpus: ByteCorpus,
    make_update: _MakeUpdate,
    log: Optional[LogFn],
    watch: Optional[WatchFn] = None,
) -> TrainResult:
    """The loop both recipes share: data, model, optimizer, scheduler, evaluation and bookkeeping."""
    start = time.perf_counter()
    if config.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build_model(config)
    num_params = model.num_params()
    if config.fsdp:
        shard_model(model, config.device)
    optimizer = _optimizer(model, config)
    scheduler = _scheduler(optimizer, config)
    update, finish = make_update(model, optimizer, scheduler)
    generator = torch.Generator().manual_seed(config.seed)
    val_batches = eval_batches(
        corpus.val, config.eval_batches, config.micro_batch_size, config.seq_len, config.seed + 1, config.device
    )
    result = TrainResult(recipe=recipe, num_params=num_params)
    log = log or (lambda record: None)
    shard, world = _rank_shard(corpus, config)

    def next_micro_batch(size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(shard, size or config.micro_batch_size, config.seq_len, generator, config.device)

    def run_eval(step: int) -> None:
        val_loss = evaluate(model, val_batches)
        result.evals.append((step, val_loss))
        log({"kind": "eval", "recipe": recipe, "step": step, "val_loss": val_loss,
             "elapsed_s": time.perf_counter() - start})

    model.train()
    try:
        for step in range(1, config.steps + 1):
            lr = scheduler.get_last_lr()[0]
            t0 = time.perf_counter()
            k, stats = update(next_micro_batch)
            # One host sync per update, for logging only: the 0-d results are read together.
            values = dict(zip(stats, torch.stack([s.float() for s in stats.values()]).tolist()))
            result.train_s += time.perf_counter() - t0
            log(_record_update(result, config, step, k, world, lr, values, start))
            if watch is not None:
                watch(step, model)
            if step == config.steps or (config.eval_interval and step % config.eval_interval == 0):
                run_eval(step)
    finally:
        finish()
    result.wall_s = time.perf_counter() - start
    result.peak_memory_bytes, result.peak_memory_kind = _peak_memory(config.device)
    return result


def train_gaengine(config: TrainConfig, corpus: ByteCorpus, log: Optional[LogFn] = None,
                   watch: Optional[WatchFn] = None) -> TrainResult:
    """Train through :class:`gaengine.GradientAccumulator`; see the module docstring. ``watch``: :data:`WatchFn`.

    Raises what the accumulator raises for a bad configuration (``ValueError``, or ``RuntimeError`` for a
    backend asked for by name that cannot load).
    """
    def make_update(model, optimizer, scheduler):
        # The optimizer is built over the model's params first; the accumulator re-points it at its fp32
        # master weights when the params are bf16/fp16.
        schedule = accumulation_schedule(config, rank_and_world()[1], optimizer, scheduler)
        acc = GradientAccumulator(model, optimizer, lr_scheduler=scheduler,
                                  **config.accumulator_config(schedule).as_kwargs())

        def update(next_micro_batch):
            result = None
            while result is None:
                x, y = next_micro_batch(acc.micro_batch_size)
                try:
                    acc.backward(model(x, y))
                except Exception as exc:
                    if not (config.auto_micro_batch and is_oom_error(exc)) or acc.micro_batch_size == 1:
                        raise
                    del exc
                    _halve_micro_batch(acc, log)
                    continue
                result = acc.step()
            stats = {"loss": result.loss, "grad_norm": result.grad_norm, "clip_coef": result.clip_coef,
                     "skipped": result.skipped}
            if result.grad_noise_scale is not None:
                stats["grad_noise_scale"] = result.grad_noise_scale
            return result.num_micro_batches, stats

        return update, acc.close

    return _run("gaengine", config, corpus, make_update, log, watch)


def _halve_micro_batch(acc: GradientAccumulator, log: Optional[LogFn]) -> None:
    """After an out-of-memory error: drop the window, halve the micro-batch, double the steps."""
    acc.zero_grad()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    old = (acc.micro_batch_size, acc.accumulation_steps)
    acc.micro_batch_size = max(1, acc.micro_batch_size // 2)
    acc.accumulation_steps = acc.accumulation_steps * old[0] // acc.micro_batch_size
    if log is not None:
        log({"kind": "oom", "recipe": "gaengine", "micro_batch_size": acc.micro_batch_size,
             "accumulation_steps": acc.accumulation_steps, "previous": list(old),
             "effective_batch_size": acc.effective_batch_size})


def train_reference(config: TrainConfig, corpus: ByteCorpus, log: Optional[LogFn] = None,
                    watch: Optional[WatchFn] = None, recipe: str = "torch") -> TrainResult:
    """Train with the plain PyTorch recipe on the same data, initialization and optimizer configuration.
    ``watch``: :data:`WatchFn`; ``recipe``: the run's name in its result and records.

    ``.grad`` accumulates in the parameter dtype over ``K`` micro-batches of ``(loss / K).backward()``;
    then ``clip_grad_norm_`` (or only the norm when clipping is off), ``optimizer.step()``,
    ``zero_grad(set_to_none=True)`` and ``scheduler.step()``. Nothing is skipped on a non-finite gradient.
    K stays ``accumulation_steps`` (``accumulation_schedule`` and ``noise_scale`` are the engine's).
    """
    k = config.accumulation_steps

    def make_update(model, optimizer, scheduler):
        params = [p for p in model.parameters() if p.requires_grad]

        def update(next_micro_batch):
            loss_sum = torch.zeros((), dtype=torch.float32, device=config.device)
            for _ in range(k):
                x, y = next_micro_batch(config.micro_batch_size)
                loss = model(x, y)
                (loss / k).backward()
                loss_sum += loss.detach().float()
            if config.max_grad_norm is None:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                clip_coef = torch.ones((), device=config.device)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                # The coefficient clip_grad_norm_ applied (torch/nn/utils/clip_grad.py).
                clip_coef = (config.max_grad_norm / (grad_norm.float() + 1e-6)).clamp(max=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            skipped = torch.zeros((), dtype=torch.bool, device=config.device)
            return k, {"loss": loss_sum / k, "grad_norm": grad_norm, "clip_coef": clip_coef, "skipped": skipped}

        return update, lambda: None

    return _run(recipe, config, corpus, make_update, log, watch)
