"""``acc.load_state_dict`` and ``gaengine.checkpoint.upgrade`` are all or nothing (issue 41: N3, N4 and the
corrupted inputs of the sweep).

A generator corrupts a state saved mid-window in every way a file can be corrupt: the meta blob truncated or with a
bit flipped, a key missing, a value of the wrong type, a value out of range, a state relabelled as an earlier
format. Each corrupted state is loaded into another accumulator, itself mid-window: the load must raise
``ValueError`` naming the key, and that accumulator's window (``main_grad``, counters and flags, the optimizer's
state, the lr_scheduler, the loss scale, the model) must be bit for bit as before. Then the state itself loads, and
the next step equals the plain recipe in fp64 (AdamW, the clip, a StepLR) run over the same micro-batches.
"""

from __future__ import annotations

import copy
import io
import re
import struct
import zipfile
from collections import Counter

import pytest
import torch

import gaengine
from gaengine.checkpoint import upgrade
from gaengine.formats import PLAIN_FORMAT, ZERO_FORMAT
from tests.models import MLP
from tests.tolerances import RTOL

K = 3
LR = 1e-2
CLIP = 0.5
LOSS_SCALE = 1024.0  # static, a power of two: scaling and unscaling are exact, so the plain recipe has none


def _build(seed: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = MLP(6, 8, 3).to(dtype)  # bf16: fp32 master weights (the default master_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=CLIP, lr_scheduler=sched,
                                       backend="torch", loss_scale=LOSS_SCALE)
    return model, acc


def _batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _loss(model, batch):
    dtype = next(model.parameters()).dtype
    x, y = batch
    return torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))


def _run(model, acc, batches) -> None:
    for b in batches:
        acc.backward(_loss(model, b))
        acc.step()


def _save(dtype: torch.dtype):
    """A state saved one micro-batch into the second window (the optimizer, the scheduler and the loss scaler have
    state), as a file holds it (``torch.save`` bytes), with the source model's initial values and its batches."""
    model, acc = _build(0, dtype)
    initial = copy.deepcopy(model)
    batches = _batches(2 * K, seed=1)
    _run(model, acc, batches[:K + 1])
    assert acc.num_micro_batches == 1
    blob = io.BytesIO()
    torch.save(acc.state_dict(), blob)
    params = copy.deepcopy(model.state_dict())  # fp32 parameters: the model's state dict holds them, not acc's
    acc.zero_grad()
    acc.close()
    return blob.getvalue(), initial, batches, params


@pytest.fixture(scope="module")
def saved():
    return _save(torch.float32)


@pytest.fixture(scope="module")
def saved_bf16():
    return _save(torch.bfloat16)


def _fresh(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _decode(meta: bytes) -> dict:
    return torch.load(io.BytesIO(meta), weights_only=True)


def _encode(meta: dict) -> bytes:
    out = io.BytesIO()
    torch.save(meta, out)
    return out.getvalue()


# ------------------------------------------------------------------ the corruption generator
def _edit_meta(edit):
    def apply(state):
        meta = _decode(state["meta"])
        edit(meta)
        state["meta"] = _encode(meta)
    return apply


def _scalars(edit):
    return _edit_meta(lambda meta: edit(meta["ranks"][0]["scalars"]))


def _set(key, value):
    return _scalars(lambda s: s.__setitem__(key, value))


def _drop(key):
    return _scalars(lambda s: s.pop(key))


def _record_offsets(blob: bytes) -> list[tuple[str, int, int]]:
    """``(name, first byte, end)`` of every record's data in a zip archive, read from its local headers."""
    out = []
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        for info in z.infolist():
            name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
            start = info.header_offset + 30 + name_len + extra_len
            out.append((info.filename, start, start + info.compress_size))
    return out


def _local_header(blob: bytes) -> int:
    """The offset of the first record's local header."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return z.infolist()[0].header_offset


def _central_directory_attr(blob: bytes, record: str) -> int:
    """The offset of the external-attributes field of ``record``'s central directory entry."""
    return blob.rindex(record.encode()) - 46 + 38  # the entry's 46 fixed bytes end right before its name


def _flip(pos: int, bit: int = 0x10):
    def apply(state):
        b = bytearray(state["meta"])
        b[pos] ^= bit
        state["meta"] = bytes(b)
    return apply


def corruptions(state: dict) -> list[tuple[str, str, str, object]]:
    """Every corruption as ``(kind, name, the key the error must name, edit)``; ``edit(state)`` corrupts a fresh
    copy of ``state`` (a state saved mid-window) in place."""
    meta = _decode(state["meta"])
    n_params = len(meta["params"])
    key0 = meta["params"][0][0]
    blob = state["meta"]
    n = len(blob)
    out: list[tuple[str, str, str, object]] = []
    m = "state['meta']"

    def add(kind, name, key, edit):
        out.append((kind, name, key, edit))

    # truncated meta bytes
    for length in (0, 1, 22, 100, n // 2, n - 22, n - 1):
        add("truncation", f"meta[:{length}]", m, lambda s, k=length: s.__setitem__("meta", s["meta"][:k]))
    # bit flips: spread over every record's data, then a central directory attribute (the record read as a
    # directory: torch's reader then reads the tensor from memory it never wrote) and a local header's name
    for name, start, end in _record_offsets(blob):
        for pos in sorted({start, (start + end) // 2, end - 1}):
            add("bit flip", f"{name}@{pos}", m, _flip(pos))
    tensor_record = next(name for name, _, _ in _record_offsets(blob) if re.search(r"/data/\d+$", name))
    add("bit flip", "directory attribute", m, _flip(_central_directory_attr(blob, tensor_record)))
    add("bit flip", "local header name", m, _flip(_local_header(blob) + 30 + 2, 0x01))
    # missing keys
    for key in ("meta", "master", "optimizer", "window_grad"):
        add("missing key", key, f"['{key}']", lambda s, k=key: s.pop(k))
    for key in ("world_size", "mode", "sharded", "window_rows", "params", "param_groups", "lr_scheduler",
                "optimizer_state", "ranks"):
        add("missing key", f"meta.{key}", f"['{key}']", _edit_meta(lambda meta, k=key: meta.pop(k)))
    for key in ("num_micro_batches", "accumulation_steps", "written", "arrival", "item_mode", "items_host",
                "items_dev", "loss_sum", "failed_backward", "scaler", "consecutive_skips", "layout_order"):
        add("missing key", f"scalars.{key}", f"['{key}']", _drop(key))
    add("missing key", "scaler.scale", "['scale']", _scalars(lambda s: s["scaler"].pop("scale")))
    add("missing key", "optimizer.initialized", "['initialized']",
        lambda s: s["optimizer"][key0].pop("initialized"))
    add("missing key", "optimizer.exp_avg", "['exp_avg']", lambda s: s["optimizer"][key0].pop("exp_avg"))
    add("missing key", "window_grad entry", "['window_grad']", lambda s: s["window_grad"].pop(key0))
    if state["master"]:  # bf16/fp16 parameters with fp32 master weights
        add("missing key", "master entry", "['master']", lambda s: s["master"].pop(key0))
        add("wrong type", "master bf16", "['master']", lambda s: s["master"].__setitem__(
            key0, s["master"][key0].bfloat16()))
        add("out of range", "master short", "['master']", lambda s: s["master"].__setitem__(
            key0, s["master"][key0][:-1]))
    # wrong types
    typed = [
        ("meta is a str", m, lambda s: s.__setitem__("meta", "meta")),
        ("meta is None", m, lambda s: s.__setitem__("meta", None)),
        ("meta decodes to a list", m, lambda s: s.__setitem__("meta", _encode([1, 2]))),
        ("master is a list", "['master']", lambda s: s.__setitem__("master", [])),
        ("optimizer is None", "['optimizer']", lambda s: s.__setitem__("optimizer", None)),
        ("window_grad is a list", "['window_grad']", lambda s: s.__setitem__("window_grad", [])),
        ("window_grad int64", "['window_grad']", lambda s: s["window_grad"].__setitem__(
            key0, s["window_grad"][key0].long())),
        ("window_grad bf16", "['window_grad']", lambda s: s["window_grad"].__setitem__(
            key0, s["window_grad"][key0].bfloat16())),
        ("exp_avg int32", "['optimizer']", lambda s: s["optimizer"][key0].__setitem__(
            "exp_avg", s["optimizer"][key0]["exp_avg"].int())),
        ("optimizer step a str", "['step']", lambda s: s["optimizer"][key0].__setitem__("step", "3")),
        ("world_size a str", "['world_size']", _edit_meta(lambda meta: meta.__setitem__("world_size", "1"))),
        ("sharded a str", "['sharded']", _edit_meta(lambda meta: meta.__setitem__("sharded", "no"))),
        ("params an int", "['params']", _edit_meta(lambda meta: meta.__setitem__("params", 3))),
        ("params[0] a str", "['params']", _edit_meta(lambda meta: meta["params"].__setitem__(0, "w"))),
        ("param_groups a dict", "['param_groups']", _edit_meta(lambda meta: meta.__setitem__("param_groups", {}))),
        ("lr a str", "['lr']", _edit_meta(lambda meta: meta["param_groups"][0].__setitem__("lr", "fast"))),
        ("betas a float", "['betas']", _edit_meta(lambda meta: meta["param_groups"][0].__setitem__("betas", 0.9))),
        ("lr_scheduler an int", "['lr_scheduler']", _edit_meta(lambda meta: meta.__setitem__("lr_scheduler", 5))),
        ("last_epoch a str", "['last_epoch']", _edit_meta(lambda meta: meta["lr_scheduler"].__setitem__(
            "last_epoch", "1"))),
        ("optimizer_state a list", "['optimizer_state']", _edit_meta(lambda meta: meta.__setitem__(
            "optimizer_state", []))),
        ("ranks a dict", "['ranks']", _edit_meta(lambda meta: meta.__setitem__("ranks", {}))),
        ("ranks[0] None", "['ranks']", _edit_meta(lambda meta: meta["ranks"].__setitem__(0, None))),
        ("scalars None", "['ranks']", _edit_meta(lambda meta: meta["ranks"][0].__setitem__("scalars", None))),
        ("num_micro_batches None", "['num_micro_batches']", _set("num_micro_batches", None)),
        ("num_micro_batches a str", "['num_micro_batches']", _set("num_micro_batches", "1")),
        ("written a str", "['written']", _set("written", "T" * n_params)),
        ("written ints", "['written']", _set("written", [1] * n_params)),
        ("expected_arrivals floats", "['expected_arrivals']", _set("expected_arrivals", [1.5] * n_params)),
        ("arrival a str", "['arrival']", _set("arrival", "0")),
        ("layout_order None", "['layout_order']", _set("layout_order", None)),
        ("layout_order strs", "['layout_order']", _set("layout_order", [str(i) for i in range(n_params)])),
        ("loss_sum a float", "['loss_sum']", _set("loss_sum", 0.5)),
        ("items_dev a list", "['items_dev']", _set("items_dev", [1])),
        ("failed_backward an int", "['failed_backward']", _set("failed_backward", 0)),
        ("scaler a list", "['scaler']", _set("scaler", [])),
        ("scale a float", "['scale']", _scalars(lambda s: s["scaler"].__setitem__("scale", 2.0))),
        ("dynamic a str", "['dynamic']", _scalars(lambda s: s["scaler"].__setitem__("dynamic", "no"))),
    ]
    out += [("wrong type", name, key, edit) for name, key, edit in typed]
    # out of range
    ranged = [
        ("num_micro_batches -1", "['num_micro_batches']", _set("num_micro_batches", -1)),
        ("num_micro_batches K+1", "['num_micro_batches']", _set("num_micro_batches", K + 1)),
        ("expected_arrivals 0", "['expected_arrivals']", _set("expected_arrivals", 0)),
        ("expected_arrivals -1", "['expected_arrivals']", _set("expected_arrivals", -1)),
        ("expected_arrivals [1,..,0]", "['expected_arrivals']", _set("expected_arrivals", [1] * (n_params - 1) + [0])),
        ("arrival out of range", "['arrival']", _set("arrival", [n_params + 5])),
        ("arrival negative", "['arrival']", _set("arrival", [-1])),
        ("written all False", "['written']", _set("written", [False] * n_params)),
        ("written short", "['written']", _set("written", [True] * (n_params - 1))),
        ("window_used short", "['window_used']", _set("window_used", [True])),
        ("layout_order repeats", "['layout_order']", _set("layout_order", [0] * n_params)),
        ("items_host -1", "['items_host']", _set("items_host", -1)),
        ("consecutive_skips -1", "['consecutive_skips']", _set("consecutive_skips", -1)),
        ("update_index -1", "['update_index']", _set("update_index", -1)),
        ("accumulation_steps 0", "['accumulation_steps']", _set("accumulation_steps", 0)),
        ("world_size 0", "['world_size']", _edit_meta(lambda meta: meta.__setitem__("world_size", 0))),
        ("ranks empty", "['ranks']", _edit_meta(lambda meta: meta.__setitem__("ranks", []))),
        ("ranks of 2 mid-window", "['ranks']", _edit_meta(lambda meta: meta["ranks"].append(meta["ranks"][0]))),
        ("scale -1", "['scale']", _scalars(lambda s: s["scaler"].__setitem__("scale", torch.tensor(-1.0)))),
        ("scale nan", "['scale']", _scalars(lambda s: s["scaler"].__setitem__("scale", torch.tensor(float("nan"))))),
        ("window_grad short", "['window_grad']", lambda s: s["window_grad"].__setitem__(
            key0, s["window_grad"][key0][:-1])),
        ("exp_avg short", "['optimizer']", lambda s: s["optimizer"][key0].__setitem__(
            "exp_avg", s["optimizer"][key0]["exp_avg"][:-1])),
        ("param shape", "['params']", _edit_meta(lambda meta: meta["params"].__setitem__(
            0, (key0, [99], *meta["params"][0][2:])))),
        ("param_groups 2", "['param_groups']", _edit_meta(lambda meta: meta["param_groups"].append(
            meta["param_groups"][0]))),
        ("base_lrs of 2", "['base_lrs']", _edit_meta(lambda meta: meta["lr_scheduler"].__setitem__(
            "base_lrs", [LR, LR]))),
    ]
    out += [("out of range", name, key, edit) for name, key, edit in ranged]
    out.append(("relabelled", "another format", "format", lambda s: s.__setitem__("format", "gaengine/9")))
    return out


RELABELLED = [(PLAIN_FORMAT, "['param_shapes']"), (ZERO_FORMAT, "['zero_stage']")]


# ------------------------------------------------------------------ the window, bit for bit
def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a.reshape(-1).view(torch.uint8),
                                                            b.reshape(-1).view(torch.uint8))))  # bits, NaN too
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _window(acc, model) -> dict:
    """Everything a refused load must leave alone, copied."""
    return copy.deepcopy({
        "main_grad": acc.main_grad.data, "params": list(model.state_dict().values()),
        "masters": None if acc.master_buffer is None else acc.master_buffer.data,
        "scalars": acc.state_parts().stages.state_items(), "optimizer": acc.optimizer.state_dict(),
        "lr_scheduler": acc.lr_scheduler.state_dict(), "k": acc.accumulation_steps,
        "grads": [p.grad for p in model.parameters()],
    })


def _target(dtype: torch.dtype = torch.float32):
    """Another run, mid-window (two micro-batches into its second window): what a refused load must keep."""
    model, acc = _build(7, dtype)
    _run(model, acc, _batches(K + 2, seed=5))
    assert acc.num_micro_batches == 2
    return model, acc


def _plain_reference(initial, batches) -> list[torch.Tensor]:
    """The plain recipe in fp64 over ``batches`` (windows of K): the mean of each window's micro-batch losses'
    gradients, ``clip_grad_norm_``, AdamW, StepLR."""
    model = copy.deepcopy(initial).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for w in range(len(batches) // K):
        opt.zero_grad()
        for b in batches[w * K:(w + 1) * K]:
            (_loss(model, b) / K).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master-weights"])
def test_every_corruption_is_refused_naming_the_key_with_the_window_kept(dtype, request):
    blob, initial, batches, params = request.getfixturevalue("saved" if dtype == torch.float32 else "saved_bf16")
    model, acc = _target(dtype)
    assert (acc.master_buffer is not None) == (dtype == torch.bfloat16)
    before = _window(acc, model)
    cases = corruptions(_fresh(blob))
    assert len(cases) >= 54, len(cases)
    refused: Counter = Counter()
    failures = []
    for kind, name, key, edit in cases:
        state = _fresh(blob)
        edit(state)
        try:
            acc.load_state_dict(state)
            failures.append(f"{kind} / {name}: accepted")
        except ValueError as exc:
            if key not in str(exc):
                failures.append(f"{kind} / {name}: ValueError not naming {key}: {exc}")
            else:
                refused[kind] += 1
        except Exception as exc:  # noqa: BLE001 - the point: any other error is a failure of the check
            failures.append(f"{kind} / {name}: {type(exc).__name__}: {exc}")
        if not _same(before, _window(acc, model)):
            failures.append(f"{kind} / {name}: the window changed")
            break
    for fmt, key in RELABELLED:  # a state relabelled as an earlier format: load refuses, upgrade() refuses
        state = _fresh(blob)
        state["format"] = fmt
        with pytest.raises(ValueError, match="upgrade"):
            acc.load_state_dict(state)
        try:
            upgrade(state, acc)
            failures.append(f"relabelled {fmt}: upgrade accepted it")
        except ValueError as exc:
            refused["relabelled"] += 1 if key in str(exc) else 0
            if key not in str(exc):
                failures.append(f"relabelled {fmt}: upgrade's ValueError does not name {key}: {exc}")
        except Exception as exc:  # noqa: BLE001
            failures.append(f"relabelled {fmt}: upgrade raised {type(exc).__name__}: {exc}")
        if not _same(before, _window(acc, model)):
            failures.append(f"relabelled {fmt}: the window changed")
    print(f"corruptions: {len(cases) + len(RELABELLED)} in {len(set(c[0] for c in cases))} kinds; refused naming "
          f"the key: {dict(refused)}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failures)"

    # The state itself loads, and the window goes on as the plain recipe's.
    model.load_state_dict(params)
    acc.load_state_dict(_fresh(blob))
    if dtype == torch.bfloat16:  # the file is the reference: the masters and the window's sums as saved, bit for bit
        saved_state = _fresh(blob)
        for (name, p), g in zip(model.named_parameters(), _sums_by_name(acc, model)):
            master = acc.optimizer.param_groups[0]["params"][list(dict(model.named_parameters())).index(name)]
            assert _same(master.detach().reshape(-1), saved_state["master"][name]), name
            assert _same(g, saved_state["window_grad"][name]), name
        acc.close()
        return
    for b in batches[K + 1:]:
        acc.backward(_loss(model, b))
    assert acc.step() is not None
    expected = _plain_reference(initial, batches)
    for (name, p), e in zip(model.named_parameters(), expected):
        # fp32 forward/backward and sum against fp64: each AdamW step moves a parameter by at most lr (its update
        # m/sqrt(v) is O(1)), so a relative error of a few fp32 roundings of the gradient moves it by that times lr
        # per step; the parameter itself rounds once per step.
        steps = 2
        tol = 64 * RTOL[torch.float32] * (steps * LR + float(e.abs().max()))
        err = float((p.detach().double() - e).abs().max())
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e} after resuming"


def _sums_by_name(acc, model) -> list[torch.Tensor]:
    """The window's fp32 sums per parameter, in the model's order (``acc.params`` is in layout order)."""
    where = {id(p): i for i, p in enumerate(acc.params)}
    return [acc.main_grad.flat_views[where[id(p)]] for p in model.parameters()]


def test_every_flipped_bit_of_the_meta_blob_is_refused_or_harmless(saved):
    """Every byte of the meta blob with one bit flipped: ``read_meta`` refuses it naming ``state['meta']``, or
    decodes exactly what was saved (a flip in bytes no reader uses)."""
    from gaengine.state_checks import read_meta

    blob = _fresh(saved[0])["meta"]
    original = _decode(blob)
    kept = refused = 0
    for pos in range(len(blob)):
        b = bytearray(blob)
        b[pos] ^= 0x10
        try:
            meta = read_meta({"meta": bytes(b)})
        except ValueError as exc:
            assert "state['meta']" in str(exc)
            refused += 1
            continue
        assert _same(meta, original), f"a flip at byte {pos} of {len(blob)} decoded to another meta"
        kept += 1
    assert refused > kept


def test_all_written_false_mid_window_is_refused(saved):
    """N4: the written flags of a state saved mid-window all False: the loaded window's sums would be overwritten by
    the next micro-batch (the window silently dropped). Refused, the window kept, and the intact state then trains
    as the plain recipe does (covered above); here the message names the flags."""
    blob = saved[0]
    model, acc = _target()
    before = _window(acc, model)
    state = _fresh(blob)
    n = len(_decode(state["meta"])["params"])
    _set("written", [False] * n)(state)
    with pytest.raises(ValueError, match=r"\['written'\] is all False"):
        acc.load_state_dict(state)
    assert _same(before, _window(acc, model))
