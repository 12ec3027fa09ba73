"""Progress of a long conversion: which phase it is in and since when.

``to_training_onnx`` marks its phases (``with phase("tracing")``); ``report(stream)`` (the CLI)
prints the running phase and the elapsed time every ``every`` seconds once a conversion has run
``after`` seconds, and nothing for a quick one. A phase is a module-level record, so marking one
costs nothing when nobody reports.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TextIO

_current = {"phase": ""}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark ``name`` as the running phase of the conversion (the previous one again after it)."""
    previous = _current["phase"]
    _current["phase"] = name
    try:
        yield
    finally:
        _current["phase"] = previous


@contextlib.contextmanager
def report(stream: TextIO, after: float = 3.0, every: float = 3.0) -> Iterator[None]:
    """While the body runs, print ``bridge: <phase> (<elapsed> s)`` to ``stream`` every ``every``
    seconds from ``after`` seconds on, and the total at the end if anything was printed."""
    start = time.monotonic()
    done = threading.Event()
    printed = []

    def tick() -> None:
        if done.wait(after):
            return
        while True:
            print(f"bridge: {_current['phase'] or 'converting'} ({time.monotonic() - start:.0f} s)", file=stream,
                  flush=True)
            printed.append(True)
            if done.wait(every):
                return

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if printed:
            print(f"bridge: converted in {time.monotonic() - start:.1f} s", file=stream, flush=True)
