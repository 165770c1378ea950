"""The compiled CPU backend's contracts: bad input to ``get_backend("cpu")`` and ``gaengine.ops`` is refused in Python
(``ValueError`` / ``TypeError``, nothing written, ``gaengine._C`` never called); the C++ contracts themselves
(``TORCH_CHECK``) are checked on ``gaengine._C`` in a child process (``tests/child_contracts.py``), so a crashing
image cannot take the test run down. The ops' values are tested per operation in ``tests/ops/`` on every backend;
the ISA and thread-count checks are in ``tests/test_cpu_isa.py``; the Python contracts of the public functions, for every
way in (``gaengine.ops`` and the backends' methods), in ``tests/test_errors.py``.
Skipped as a whole when the extension is not built (``GAENGINE_BUILD_EXT=0``, or a failed ``auto`` build).
"""

from __future__ import annotations


import pytest
import torch

_C = pytest.importorskip("gaengine._C", reason="gaengine._C is not built (pip install --no-build-isolation -e .)")

from gaengine.backends import get_backend  # noqa: E402
from tests import child_contracts  # noqa: E402
from tests.child_contracts import check_raw_contracts  # noqa: E402
from tests.tolerances import assert_bitwise_equal  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_PARAMS = [pytest.param(dt, id=name) for name, dt in DTYPES.items()]
def test_backend_is_the_extension():
    backend = get_backend("cpu")
    assert backend.name == "cpu" and backend._C is _C


# ---------------------------------------------------------------------------------------------- accumulate_


# ------------------------------------------------------------------------------------------------ l2norm_sq


# --------------------------------------------------------------------------------------------------- errors


def strided(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(n, 2, dtype=dtype)[:, 0]


# The C++ contracts themselves (TORCH_CHECK in csrc/cpu_ops.cpp), called on gaengine._C directly. They run in a
# child process (tests/child_contracts.py): on an image whose extensions crash on a failed TORCH_CHECK the child
# dies, and the test skips when a plain load_inline extension crashes the same way, or fails when it does not.
# Each setup defines check(): the refused call wrote nothing.
_KEEP = "dst = torch.randn(4); before = dst.clone()\ndef check(): assert torch.equal(dst, before), 'dst was written'\n"
_KEEP_X = "x = torch.randn(4); before = x.clone()\ndef check(): assert torch.equal(x, before), 'x was written'\n"
_KEEP_SUMSQ = ("dst = torch.randn(8); before = dst.clone()\n"
               "def check(): assert torch.equal(dst, before), 'dst was written'\n")
_RAW_CONTRACTS = [
    ("dst-fp64", "", "_C.accumulate_(torch.zeros(4, dtype=torch.float64), torch.zeros(4), 1.0, False)",
     "dst must be float32"),
    ("dst-bf16", "", "_C.accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), 1.0, False)",
     "dst must be float32"),
    ("src-int32", _KEEP, "_C.accumulate_(dst, torch.zeros(4, dtype=torch.int32), 1.0, False)",
     "src must be float32, bfloat16 or float16"),
    ("src-fp64", _KEEP, "_C.accumulate_(dst, torch.zeros(4, dtype=torch.float64), 1.0, False)",
     "src must be float32, bfloat16 or float16"),
    ("dst-strided", "", "_C.accumulate_(strided(4), torch.zeros(4), 1.0, False)", "dst must be contiguous"),
    ("src-strided", _KEEP, "_C.accumulate_(dst, strided(4, torch.bfloat16), 1.0, False)", "src must be contiguous"),
    ("numel-mismatch", _KEEP, "_C.accumulate_(dst, torch.ones(3, dtype=torch.bfloat16), 1.0, False)",
     "src has 3 elements but dst has 4"),
    ("dst-meta", "", "_C.accumulate_(torch.zeros(4, device='meta'), torch.zeros(4), 1.0, False)",
     "dst must be a CPU tensor"),
    ("src-meta", _KEEP, "_C.accumulate_(dst, torch.zeros(4, device='meta'), 1.0, False)", "src must be a CPU tensor"),
    ("norm-int64", "", "_C.l2norm_sq(torch.zeros(4, dtype=torch.int64))", "x must be float32, bfloat16 or float16"),
    ("norm-strided", "", "_C.l2norm_sq(strided(4))", "x must be contiguous"),
    ("norm-meta", "", "_C.l2norm_sq(torch.zeros(4, device='meta'))", "x must be a CPU tensor"),
    ("scale-bf16", "", "_C.scale_(torch.zeros(4, dtype=torch.bfloat16), torch.tensor(1.0))", "x must be float32"),
    ("scale-strided", "", "_C.scale_(strided(4), torch.tensor(1.0))", "x must be contiguous"),
    ("coef-1d", _KEEP_X, "_C.scale_(x, torch.ones(1))", "coef must be a 0-d tensor"),
    ("coef-meta", _KEEP_X, "_C.scale_(x, torch.tensor(1.0, device='meta'))", "coef must be a CPU tensor"),
    ("partials-fp32", _KEEP_SUMSQ, "_C.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], torch.zeros(1, 2))",
     "partials must be float64"),
    ("partials-shape-n3", _KEEP_SUMSQ, "_C.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], torch.zeros(1, 3, "
     "dtype=torch.float64))", r"partials must have shape \(1, 2\)"),
    ("partials-rows", _KEEP_SUMSQ, "_C.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], torch.zeros(2, 2, "
     "dtype=torch.float64))", r"partials must have shape \(1, 2\)"),
    ("partials-1d", _KEEP_SUMSQ, "_C.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], torch.zeros(2, "
     "dtype=torch.float64))", r"partials must have shape \(1, 2\)"),
    ("partials-strided", _KEEP_SUMSQ, "_C.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], torch.zeros(1, 4, "
     "dtype=torch.float64)[:, ::2])", "partials must be contiguous"),
    ("partials-meta", _KEEP_SUMSQ, "_C.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], torch.zeros(1, 2, "
     "dtype=torch.float64, device='meta'))", "partials must be a CPU tensor"),
]


def test_raw_cpp_contracts_name_the_argument():
    """Every TORCH_CHECK of gaengine._C's CPU ops raises RuntimeError naming the argument and writes nothing."""
    check_raw_contracts(_RAW_CONTRACTS)


def test_raw_contract_child_reports_a_wrong_message():
    """The child harness itself: a case whose message does not match is reported, not silently passed."""
    with pytest.raises(AssertionError, match="norm-int64: expected RuntimeError matching 'no such message'"):
        check_raw_contracts([("norm-int64", "", "_C.l2norm_sq(torch.zeros(4, dtype=torch.int64))", "no such message")])


_SEGFAULT = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"


def test_raw_contract_child_crash_skips_when_every_extension_crashes(monkeypatch):
    monkeypatch.setattr(child_contracts, "control_crashes", lambda: (True, "control died of SIGSEGV"))
    with pytest.raises(pytest.skip.Exception, match="crash on a failed TORCH_CHECK"):
        check_raw_contracts([("crash", "", _SEGFAULT, "")])


def test_raw_contract_child_crash_fails_when_only_ours_crashes(monkeypatch):
    monkeypatch.setattr(child_contracts, "control_crashes", lambda: (False, "control exit 0: raised RuntimeError"))
    with pytest.raises(pytest.fail.Exception, match=r"in case 'crash'\) died of SIGSEGV.*the crash is gaengine's"):
        check_raw_contracts([("crash", "", _SEGFAULT, "")])


def test_control_extension_raises_runtime_error():
    """The control itself (a load_inline module failing a TORCH_CHECK; built once, about 30 s): on a healthy
    image it raises RuntimeError; where it crashes, this test skips with the reason the raw-contract tests give."""
    crashed, detail = child_contracts.control_crashes()
    if crashed:
        pytest.skip(child_contracts.CRASH_SKIP_REASON)
    assert "raised RuntimeError: control: a failed TORCH_CHECK" in detail, detail


# The same contracts through the public functions (every backend's methods and gaengine.ops, refused in Python before
# gaengine._C is called): tests/test_errors.py, once for every way in.


def test_cpu_backend_never_reaches_a_failed_torch_check(monkeypatch):
    """Every bad call above stops in Python: gaengine._C is not even called (a spy that fails if it is)."""
    backend = get_backend("cpu")

    class Spy:
        def __getattr__(self, name):
            raise AssertionError(f"gaengine._C.{name} was called with arguments Python should have refused")

    monkeypatch.setattr(backend, "_C", Spy())
    dst, partials = torch.randn(8), torch.zeros(2, 2, dtype=torch.float64)
    bad_calls = [
        lambda: backend.accumulate_(dst, torch.ones(3)),
        lambda: backend.accumulate_(dst, torch.ones(8, dtype=torch.float64)),
        lambda: backend.accumulate_(torch.zeros(8, device="meta"), torch.ones(8, device="meta")),
        lambda: backend.accumulate_(dst, torch.ones(8), torch.ones(2)),
        lambda: backend.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], partials),
        lambda: backend.accumulate_bucket_(dst, [torch.ones(8)], [1], [False]),
        lambda: backend.accumulate_bucket_(dst, [torch.ones(8)], [0], [False], partials[:1].float()),
        lambda: backend.l2norm_sq(torch.zeros(8, dtype=torch.int32)),
        lambda: backend.l2norm_sq(torch.zeros(8, device="meta")),
        lambda: backend.scale_(dst, torch.ones(2)),
        lambda: backend.scale_(strided(8), torch.tensor(1.0)),
        lambda: backend.scale_(dst.to(torch.bfloat16), torch.tensor(1.0)),
    ]
    for call in bad_calls:
        with pytest.raises((ValueError, TypeError)):
            call()


def test_failed_contract_leaves_dst_untouched():
    dst = torch.randn(4)
    before = dst.clone()
    with pytest.raises(ValueError, match="src has 3 elements"):
        get_backend("cpu").accumulate_(dst, torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="src has 3 elements"):  # ContractError: also what TORCH_CHECK raised
        get_backend("cpu").accumulate_(dst, torch.ones(3, dtype=torch.bfloat16))
    assert_bitwise_equal(dst, before)
