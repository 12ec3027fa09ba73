"""Atomic writes: every file bridge writes appears whole or not at all.

A ``AtomicWriter`` hands out temporary paths next to their targets, named
``.<target name>.bridge-tmp-<pid>-<random>`` (recognisable, hidden), and on success renames
them all onto their targets (``os.replace``); on any failure, a ``KeyboardInterrupt`` or a
SIGTERM (turned into ``SystemExit`` while a write is under way, in the main thread) the
temporaries are removed. A process killed outright (SIGKILL) cannot clean up: the next write
into the same folder removes temporaries whose process is gone (``remove_stale``).
Files get the mode ``open`` gives under the umask (0644 for umask 022), as ``onnx.save`` does.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputPathError

TAG = ".bridge-tmp-"
_STALE = re.compile(r"^\..+" + re.escape(TAG) + r"(\d+)-[0-9a-f]+$")


def check_output_path(path: str | os.PathLike, option: str = "output path") -> Path:
    """``path`` as a file that can be written: not a folder, its folder creatable and writable."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{option} '{path}' is a folder; give a file name inside it")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"{option} '{path}': '{ancestor}' is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} '{path}': the folder '{ancestor}' is not writable")
    return path


def remove_stale(folder: Path) -> list[Path]:
    """Remove temporaries in ``folder`` left by bridge processes that no longer run."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            match = _STALE.match(entry.name)
            if match and not _alive(int(match.group(1))):
                _remove(entry)
                removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


class AtomicWriter:
    """Temporaries for one or more targets, renamed onto them together when the block succeeds."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Path, Path]] = []
        self._scratch: list[Path] = []

    def path(self, target: str | os.PathLike, option: str = "output path") -> Path:
        """A temporary file path for ``target`` (in its folder, created if needed)."""
        target = check_output_path(target, option)
        temp = self._temp_for(target)
        self._pairs.append((temp, target))
        return temp

    def folder(self, target: str | os.PathLike, option: str = "output path") -> Path:
        """A temporary folder next to ``target`` (removed at the end), for files written together;
        ``add`` registers each of them."""
        temp = self._temp_for(check_output_path(target, option))
        temp.mkdir()
        self._scratch.append(temp)
        return temp

    def add(self, temp: Path, target: Path) -> None:
        """Rename ``temp`` onto ``target`` with the others at the end."""
        self._pairs.append((Path(temp), Path(target)))

    def _temp_for(self, target: Path) -> Path:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputPathError(f"cannot create the folder of '{target}': {exc}") from exc
        remove_stale(target.parent)
        temp = target.parent / f".{target.name}{TAG}{os.getpid()}-{secrets.token_hex(4)}"
        self._scratch.append(temp)
        return temp

    def commit(self) -> None:
        """Rename every temporary onto its target (in the order they were asked for)."""
        umask = _umask()
        for temp, target in self._pairs:
            os.chmod(temp, 0o666 & ~umask)
            os.replace(temp, target)

    def cleanup(self) -> None:
        for path in self._scratch:
            _remove(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_writer() -> Iterator[AtomicWriter]:
    """``with atomic_writer() as w: write to w.path(target) ...``: all targets appear at the end, or none."""
    writer = AtomicWriter()
    try:
        with _sigterm_as_exit():
            yield writer
            writer.commit()
    finally:
        writer.cleanup()


def write_text(path: str | os.PathLike, text: str, option: str = "output path") -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_writer() as writer:
        writer.path(path, option).write_text(text, encoding="utf-8")
    return Path(path)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While writing (main thread only), SIGTERM raises ``SystemExit`` so the temporaries are removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
