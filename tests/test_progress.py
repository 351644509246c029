"""``aotlm.progress.bar``: a bar on a terminal; where stderr is not one (a log file, a container's
log), a line on the ``aotlm`` logger every ``LOG_EVERY`` s of a long loop, so a first start that
compiles for minutes is never silent; nothing when progress is off."""

from __future__ import annotations

import io
import logging

import pytest

from aotlm import progress


class Clock:
    """``time.monotonic`` that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def progress_on(caplog):
    """Progress on and the ``aotlm`` logger's records seen, whatever earlier tests did (a CLI test's
    ``--quiet`` turns progress off for the process; ``setup_logging`` stops propagation)."""
    before = progress.enabled()
    progress.set_enabled(True)
    log = logging.getLogger("aotlm")
    level, propagate = log.level, log.propagate
    log.addHandler(caplog.handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # each record once (caplog's handler is on the root logger too)
    yield
    log.removeHandler(caplog.handler)
    log.setLevel(level)
    log.propagate = propagate
    progress.set_enabled(before)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())  # not a terminal
    return c


def run(items, clock, step_s: float, **kw) -> list:
    out = []
    for item in progress.bar(items, "compiling buckets", unit="graph", **kw):
        out.append(item)
        clock.now += step_s  # the loop's body takes step_s
    return out


def test_a_long_loop_logs_a_line_every_log_every_seconds(clock, caplog):
    assert run(range(10), clock, 11.0, total=10) == list(range(10))  # 110 s in all
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["compiling buckets: 3 of 10 graphs, 33 s", "compiling buckets: 6 of 10 graphs, 66 s",
                     "compiling buckets: 9 of 10 graphs, 99 s"]  # fmt: skip
    caplog.clear()
    run(iter(range(3)), clock, 31.0)  # no total: the count alone (the end is not known ahead)
    assert [r.getMessage() for r in caplog.records] == [
        "compiling buckets: 1 graph, 31 s",
        "compiling buckets: 2 graphs, 62 s",
        "compiling buckets: 3 graphs, 93 s",
    ]


def test_a_short_loop_and_a_quiet_one_log_nothing(clock, caplog):
    run(range(20), clock, 1.0, total=20)  # 20 s: under LOG_EVERY
    with progress.quiet():
        run(range(5), clock, 60.0, total=5)
    assert caplog.records == []


def test_a_terminal_gets_the_bar_not_log_lines(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(progress.sys, "stderr", Tty())
    pytest.importorskip("tqdm", reason="bars are tqdm's")
    wrapped = progress.bar(range(3), "loading weights", total=3, unit="tensor")
    assert type(wrapped).__name__ == "tqdm" and list(wrapped) == [0, 1, 2]
