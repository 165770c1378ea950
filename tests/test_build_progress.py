"""The build's progress while a file compiles (issue 34): ``setup.py`` prints a line every ``HEARTBEAT_S`` (<= 30)
seconds naming the files not compiled yet and the time so far, so that a build that takes minutes per file on a
busy machine never looks hung. Nothing is compiled: a fake ``build_ext`` whose ``run`` writes one object and then
stays silent stands for a slow compile, and the heartbeat runs at a 10 ms interval."""

from __future__ import annotations

import os
import threading
import time

import pytest
from setuptools import Extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_build_speaks_at_least_every_30_seconds(setup_py):
    assert 0 < setup_py.HEARTBEAT_S <= 30
    defaults = setup_py.fallback_build_ext.__defaults__
    assert setup_py.HEARTBEAT_S in defaults  # fallback_build_ext's heartbeat_s, what main()'s build gets


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (29.9, "29 s"), (60, "1 min 0 s"), (90.5, "1 min 30 s"),
                                           (3725, "62 min 5 s")])
def test_format_elapsed(setup_py, seconds, text):
    assert setup_py.format_elapsed(seconds) == text


def _touch(path, mtime):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()
    os.utime(path, (mtime, mtime))


def test_compile_progress_names_the_files_not_compiled_yet(setup_py, tmp_path):
    sources = ["csrc/a.cpp", "csrc/hot_path.cpp", "csrc/cuda/k.cu", "csrc/b.cpp", "csrc/c.cpp"]
    start = time.time()
    _touch(tmp_path / "csrc" / "a.o", start + 5)  # compiled in this build
    _touch(tmp_path / "csrc" / "b.o", start - 3600)  # left over from an earlier build: not this build's
    line = setup_py.compile_progress(sources, str(tmp_path), start, 90.2)
    assert line == "gaengine: still compiling csrc/hot_path.cpp, csrc/cuda/k.cu and 2 more (1 min 30 s; 1 of 5 done)"
    assert len(line) <= 100
    for src in sources[1:]:
        _touch(tmp_path / (os.path.splitext(src)[0] + ".o"), start + 6)
    assert setup_py.compile_progress(sources, str(tmp_path), start, 125) == "gaengine: still linking gaengine._C " \
                                                                            "(2 min 5 s)"


def test_heartbeat_prints_while_the_body_runs_and_stops_after(setup_py):
    lines, beats = [], threading.Semaphore(0)

    def log(line):
        lines.append(line)
        beats.release()

    ticks = iter(range(0, 10_000, 30))  # a fake clock: 30 s pass between two readings
    with setup_py.BuildHeartbeat(lambda s: f"still compiling ({setup_py.format_elapsed(s)})", 0.01, log,
                                 clock=lambda: next(ticks)):
        for _ in range(3):  # a silent step that outlasts three intervals
            assert beats.acquire(timeout=30)
    count = len(lines)
    time.sleep(0.05)  # five intervals after the body: no line comes
    assert len(lines) == count >= 3
    assert lines[:3] == ["still compiling (30 s)", "still compiling (1 min 0 s)", "still compiling (1 min 30 s)"]
    with pytest.raises(ValueError, match="interval_s must be > 0 seconds, got 0"):
        setup_py.BuildHeartbeat(str, 0)


def test_heartbeat_survives_a_failing_description(setup_py):
    lines, beat = [], threading.Event()

    def describe(_):
        raise OSError("build folder gone")

    with setup_py.BuildHeartbeat(describe, 0.01, lambda line: (lines.append(line), beat.set())):
        assert beat.wait(timeout=30)
    assert lines[0] == "gaengine: still building gaengine._C (progress unknown: build folder gone)"


class SlowBuildExt:
    """What ``fallback_build_ext`` needs of setuptools' ``build_ext``, with a ``run`` that stays silent until two
    progress lines came: a slow compile."""

    def __init__(self, extensions, build_temp, heard):
        self.extensions, self.build_temp, self.compiler, self.inplace = extensions, build_temp, None, True
        self.heard = heard

    def run(self):
        for _ in range(2):
            assert self.heard.acquire(timeout=30), "no progress line while the build was silent"


def test_fallback_build_ext_runs_the_build_under_the_heartbeat(setup_py, tmp_path):
    """The ``build_ext`` that ``main()`` installs (``fallback_build_ext``): while its build runs, the lines name the
    file still compiling, and count the one whose object is in ``build_temp`` (written "during" the build: its
    time is a minute ahead); the build's own log is untouched."""
    lines, heard, log = [], threading.Semaphore(0), []

    def heartbeat_log(line):
        lines.append(line)
        heard.release()

    _touch(tmp_path / "csrc" / "a.o", time.time() + 60)
    ext = Extension("gaengine._C", ["csrc/a.cpp", "csrc/hot_path.cpp"])
    cls = setup_py.fallback_build_ext(SlowBuildExt, None, strict=True, log=log.append, heartbeat_s=0.01,
                                      heartbeat_log=heartbeat_log)
    cls([ext], str(tmp_path), heard).run()
    assert len(lines) >= 2 and log == []
    assert all(line.startswith("gaengine: still compiling csrc/hot_path.cpp (") and line.endswith("; 1 of 2 done)")
               for line in lines)
