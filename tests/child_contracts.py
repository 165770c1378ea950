"""Run checks of the compiled ops' raw ``TORCH_CHECK`` contracts in a child Python process.

A failed ``TORCH_CHECK`` must raise ``RuntimeError``; on some images it kills the interpreter with SIGSEGV
instead (csrc/README.md, "Errors from C++"). Calling ``gaengine._C`` with bad input inside the pytest process
would take the whole run down there, so these checks run in a child, one child for a whole table, which prints
one line per case as it goes. When the child dies of a signal, a control decides whose crash it is: a tiny
``torch.utils.cpp_extension.load_inline`` module whose only function fails a ``TORCH_CHECK``, in another child.

* The control crashes too: this image's extensions crash on any failed ``TORCH_CHECK``, ours included; the
  test skips with ``CRASH_SKIP_REASON`` (the public functions never get there: they check in Python first).
* The control raises ``RuntimeError``: the crash is gaengine's; the test fails.

On a healthy image (CPU CI) nothing crashes and every case is checked in full.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CRASH_SKIP_REASON = "this image's extensions crash on a failed TORCH_CHECK (see csrc/README.md)"
# Signals that mean "the interpreter died" rather than "a check failed": SIGSEGV is the one seen; a C++ exception
# nobody catches (std::terminate) ends in SIGABRT, and a bad read can be SIGBUS.
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT}

_CHILD_MAIN = textwrap.dedent(
    """
    import json, sys
    import torch
    import gaengine._C  # registers torch.ops.gaengine

    # _C.<op>(...): the CPU kernel of torch.ops.gaengine.<op>, called under the CPU dispatch key, so a meta
    # argument reaches the kernel's CHECK_CPU (the dispatcher would send it to the fake kernel).
    class CpuKernels:
        def __getattr__(self, op):
            keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
            overload = getattr(torch.ops.gaengine, op).default
            return lambda *args, **kwargs: overload.redispatch(keys, *args, **kwargs)

    _C = CpuKernels()
    cases = json.loads(sys.stdin.read())
    env = {"torch": torch, "_C": _C, "strided": lambda n, dtype=torch.float32: torch.zeros(n, 2, dtype=dtype)[:, 0]}
    for case_id, setup, call in cases:
        scope = dict(env)
        exec(setup, scope)
        print(json.dumps([case_id, "started", ""]), flush=True)  # the case a crash happened in
        try:
            exec(call, scope)
        except Exception as exc:  # the outcome is judged by the parent
            outcome = [case_id, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""]
        else:
            outcome = [case_id, "no error", ""]
        if "check" in scope:  # what must still hold after the refused call (e.g. nothing written)
            try:
                scope["check"]()
            except AssertionError as exc:
                outcome = [case_id, "AssertionError", "after the call: " + str(exc)]
        print(json.dumps(outcome), flush=True)
    """
)

_CONTROL = textwrap.dedent(
    """
    import sys
    import tempfile
    import torch
    from torch.utils.cpp_extension import load_inline
    # A build directory of its own: torch's shared cache (~/.cache/torch_extensions) keeps a lock file that a build
    # killed midway leaves behind, and every later control would wait on it forever.
    module = load_inline(
        "gaengine_torch_check_control",
        cpp_sources='void fail() { TORCH_CHECK(false, "control: a failed TORCH_CHECK"); }',
        functions=["fail"],
        verbose=False,
        build_directory=tempfile.mkdtemp(prefix="gaengine-control-"),
    )
    try:
        module.fail()
    except RuntimeError as exc:
        print("raised RuntimeError:", str(exc).splitlines()[0])
        sys.exit(0)
    print("no RuntimeError")
    sys.exit(1)
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def died_of_signal(proc: subprocess.CompletedProcess) -> signal.Signals | None:
    """The crash signal ``proc`` died of (negative return code on POSIX), or None."""
    if proc.returncode < 0 and -proc.returncode in {int(s) for s in CRASH_SIGNALS}:
        return signal.Signals(-proc.returncode)
    return None


@functools.lru_cache(maxsize=1)
def control_crashes() -> tuple[bool, str]:
    """Does a plain ``load_inline`` extension crash on a failed ``TORCH_CHECK`` on this image? (and what it said)

    Built once per session, in a temporary directory of its own; about 30 s.
    """
    proc = subprocess.run([sys.executable, "-c", _CONTROL], env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    sig = died_of_signal(proc)
    if sig is not None:
        return True, f"control died of {sig.name}"
    said = f"{proc.stdout.strip()} {proc.stderr.strip()[-2000:]}".strip()
    return False, f"control exit {proc.returncode}: {said}"


def skip_or_fail_on_crash(proc: subprocess.CompletedProcess, what: str) -> None:
    """If ``proc`` died of a crash signal: skip when the control crashes as well, else fail (ours)."""
    sig = died_of_signal(proc)
    if sig is None:
        return
    crashed, detail = control_crashes()
    if crashed:
        pytest.skip(CRASH_SKIP_REASON)
    pytest.fail(f"{what} died of {sig.name}, but a plain load_inline extension's failed TORCH_CHECK raises "
                f"RuntimeError on this image ({detail}): the crash is gaengine's.\nstderr:\n{proc.stderr[-3000:]}")


def check_raw_contracts(cases: list[tuple[str, str, str, str]], timeout: int = 300) -> None:
    """Run each ``(id, setup, call, regex)`` in one child: ``call`` must raise ``RuntimeError`` matching ``regex``.

    ``setup`` and ``call`` are Python source run with ``torch``, ``_C`` (``_C.<op>``: the CPU kernel of
    ``torch.ops.gaengine.<op>``, whatever its arguments' devices) and ``strided(n, dtype)``
    in scope; ``setup`` may define ``check()``, run after the refused call (e.g. to assert nothing was written).
    All mismatches are reported together.
    """
    import re  # noqa: PLC0415

    payload = json.dumps([[case_id, setup, call] for case_id, setup, call, _ in cases])
    proc = subprocess.run([sys.executable, "-c", _CHILD_MAIN], input=payload, env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    outcomes: dict[str, tuple[str, str]] = {}
    last_started = None
    for line in proc.stdout.splitlines():
        case_id, kind, message = json.loads(line)
        if kind == "started":
            last_started = case_id
        else:
            outcomes[case_id] = (kind, message)
    if died_of_signal(proc) is not None:
        skip_or_fail_on_crash(proc, f"the raw-contract child (in case {last_started!r})")
    assert proc.returncode == 0, f"the raw-contract child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    problems = []
    for case_id, _, _, regex in cases:
        kind, message = outcomes.get(case_id, ("not run", ""))
        if kind != "RuntimeError" or not re.search(regex, message):
            problems.append(f"{case_id}: expected RuntimeError matching {regex!r}, got {kind}: {message!r}")
    assert not problems, "raw C++ contracts:\n" + "\n".join(problems)
