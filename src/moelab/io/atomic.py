"""The one atomic writer: every file moelab writes goes through :func:`atomic_write_bytes`.

A file is written to a temporary name in its own folder, flushed and fsynced, then renamed over
the target with ``os.replace`` (atomic on POSIX and Windows) and the folder fsynced: a process
killed at any moment leaves either the old file or the new one, never half of one.  A folder of
files that belong together (a training checkpoint) is built under a temporary name with
:func:`atomic_directory` and renamed into place in one step.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_checked",
    "atomic_write_json",
    "atomic_write_png",
    "atomic_write_text",
    "atomic_write_torch",
    "check_digest",
    "is_temporary",
    "own_folder",
    "read_json",
    "record_write",
    "recording",
    "release_folder",
    "remove_stale_temporaries",
    "set_write_hook",
    "sha256_file",
    "vouched",
    "write_event",
]

#: The write-event hook, ``None`` in production: called at each write event of this process (an
#: :func:`atomic_write_bytes` after its temporary file is complete and before the rename, an
#: :func:`atomic_directory` before the folder's rename, a ``log.csv`` append before the row is
#: written).  The crash harness (tests/test_crash_harness.py) installs one with
#: :func:`set_write_hook` that kills the process at a chosen event.
_write_hook: Callable[[], None] | None = None


#: The manifest of a run folder: the path (relative, POSIX) of every file and folder moelab wrote
#: there, one a line, appended *before* each write, so that ``--force`` removes exactly what moelab
#: wrote (never a user's CSV, an earlier run of theirs or an input of the command), even after a
#: kill.  A folder entry ends in ``/`` (a checkpoint built whole).
MANIFEST = ".moelab-files"
#: the folders whose writes this process records (resolved path → the entries listed already)
_OWNED: dict[Path, set[str]] = {}


def own_folder(root: str | os.PathLike) -> None:
    """Record every later write of this process beneath ``root`` in ``root``'s manifest."""
    root = Path(root).resolve()
    _OWNED[root] = set(manifest_entries(root))


def release_folder(root: str | os.PathLike) -> None:
    """Stop recording the writes beneath ``root``."""
    _OWNED.pop(Path(root).resolve(), None)


@contextmanager
def recording(*folders: str | os.PathLike) -> Iterator[None]:
    """Record the writes of the block in the manifests of ``folders`` (those this process does not
    own already): for the commands that write into a run without opening it (``diagnose``,
    ``report``), so that a later ``--force`` removes what they wrote too."""
    added = []
    for folder in folders:
        key = Path(folder).resolve()
        if key not in _OWNED and key.is_dir():
            own_folder(key)
            added.append(key)
    try:
        yield
    finally:
        for key in added:
            release_folder(key)


def manifest_entries(root: str | os.PathLike) -> list[str]:
    """The entries of ``root``'s manifest (``[]`` without one); an entry that would leave ``root``
    (absolute, ``..``) is dropped, whatever wrote it."""
    try:
        lines = (Path(root) / MANIFEST).read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    return [e for e in dict.fromkeys(lines) if e and not e.startswith("/") and ".." not in e.split("/")]


def reset_manifest(root: str | os.PathLike) -> None:
    """Forget ``root``'s manifest (its files were removed)."""
    (Path(root) / MANIFEST).unlink(missing_ok=True)
    key = Path(root).resolve()
    if key in _OWNED:
        _OWNED[key] = set()


def record_write(path: str | os.PathLike, folder: bool = False) -> None:
    """List ``path`` (a file, or with ``folder`` a folder written whole) in the manifest of every
    folder this process owns that holds it; called before the write.  Paths beneath a temporary
    folder are not listed (the folder is, under its final name, when it is renamed into place).  A
    nested folder's manifest listed (a run another process writes: ``compare``'s workers) stands for
    what that manifest lists."""
    if not _OWNED:
        return
    path = Path(path)
    target = path.parent.resolve() / path.name
    for root, listed in _OWNED.items():
        if root not in target.parents:
            continue
        rel = target.relative_to(root)
        if any(is_temporary(part) for part in rel.parts) or rel.as_posix() == MANIFEST:
            continue
        entry = rel.as_posix() + ("/" if folder else "")
        if entry in listed:
            continue
        with open(root / MANIFEST, "a", encoding="utf-8") as f:
            f.write(entry + "\n")
            f.flush()
            os.fsync(f.fileno())
        listed.add(entry)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder, so that a rename inside it survives a power loss (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def set_write_hook(hook: Callable[[], None] | None) -> None:
    """Install ``hook`` to run at every write event (``None``: remove it); for tests only."""
    global _write_hook
    _write_hook = hook


def write_event() -> None:
    """One file-system write event of this process: where the crash harness's hook runs."""
    if _write_hook is not None:
        _write_hook()


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc/self/status``);
    elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):  # pragma: no cover - not Linux
        pass
    mask = os.umask(0o022)  # pragma: no cover
    os.umask(mask)  # pragma: no cover
    return mask  # pragma: no cover


def _sync(fd: int, path: Path) -> None:
    """fsync the open temporary file that will become ``path`` (the one place every write makes
    durable; the reliability tests stand a kill in here)."""
    os.fsync(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, event: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename.

    The file gets the mode of any new file (0666 less the umask).  On an error the temporary
    file is removed and ``path`` is left as it was; an interrupt (``KeyboardInterrupt``, like a
    kill) leaves at most a hidden ``.{name}.*.tmp`` file, which :func:`remove_stale_temporaries`
    removes when the run next starts.  ``event``: whether the write is a write event of the crash
    harness (the digest book's are not: they come in pairs around a write that is one).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record_write(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a written file has the mode any other file of the user
        # gets (0666 less the umask), so that who may read log.csv may read metrics.json too
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            _sync(f.fileno(), path)
        if event:
            write_event()
        os.replace(tmp, path)
    except Exception:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """:func:`atomic_write_bytes` of ``obj`` as indented, key-sorted JSON (NaN/inf refused)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def atomic_write_torch(path: str | os.PathLike, obj: Any) -> Path:
    """:func:`atomic_write_bytes` of ``torch.save(obj)``; read it back with
    ``torch.load(path, weights_only=True)`` (tensors, numbers, strings and containers only)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def atomic_write_png(path: str | os.PathLike, figure: Any, dpi: int = 100) -> Path:
    """:func:`atomic_write_bytes` of a matplotlib ``figure`` as PNG: every PNG moelab writes comes
    here, so a kill never leaves half a picture and a figure drawn again from the same numbers is
    the same bytes (no ``Software`` line naming the matplotlib version).  A figure pyplot manages is
    closed afterwards (pyplot keeps every open figure alive); layout (``tight_layout``) is the
    caller's, who drew it."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None})
    pyplot = sys.modules.get("matplotlib.pyplot")  # not loaded: no figure of this process is pyplot's
    if pyplot is not None:
        pyplot.close(figure)
    return atomic_write_bytes(path, buffer.getvalue())


#: The digest book of a folder: the sha256 of each result moelab reads back (``metrics.json``,
#: ``diagnostics.json``, ``cost.json``: :func:`atomic_write_checked`), so that an edited one is
#: refused by :func:`read_json`, not trusted.
DIGESTS = ".moelab-digests.json"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _book(folder: Path) -> dict[str, list[str]]:
    file = folder / DIGESTS
    if not file.is_file():
        return {}
    try:
        book = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{str(file)!r} is not valid JSON ({exc}); remove it to trust the files it vouched for"
        ) from None
    if not isinstance(book, dict):
        raise ValueError(f"{str(file)!r} must hold a mapping of file names to digests")
    return book


def atomic_write_checked(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`atomic_write_bytes` of a result moelab reads back, its sha256 kept in the folder's
    :data:`DIGESTS` book.  While the file is replaced the book accepts the old and the new content,
    so a kill at any moment leaves a file the book vouches for."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = _digest(data)
    book = _book(path.parent)
    old = [_digest(path.read_bytes())] if path.is_file() else []
    if book.get(path.name) != [new]:
        book[path.name] = list(dict.fromkeys([*old, new]))
        atomic_write_bytes(path.parent / DIGESTS, _book_bytes(book), event=False)
    atomic_write_bytes(path, data)
    if book[path.name] != [new]:
        book[path.name] = [new]
        atomic_write_bytes(path.parent / DIGESTS, _book_bytes(book), event=False)
    return path


def _book_bytes(book: dict[str, list[str]]) -> bytes:
    return (json.dumps(book, indent=1, sort_keys=True) + "\n").encode("utf-8")


def vouched(path: str | os.PathLike, data: bytes) -> bool:
    """Whether the folder's :data:`DIGESTS` book records ``data``'s sha256 for ``path``."""
    path = Path(path)
    return _digest(data) in (_book(path.parent).get(path.name) or [])


def check_digest(path: str | os.PathLike, data: bytes) -> None:
    """Refuse, in one line, the content ``data`` of ``path`` when its folder's :data:`DIGESTS` book
    records other digests for it (the file was edited after moelab wrote it)."""
    path = Path(path)
    accepted = _book(path.parent).get(path.name)
    if accepted and _digest(data) not in accepted:
        raise ValueError(
            f"{str(path)!r} was changed after moelab wrote it (its sha256 is not the one recorded in "
            f"{DIGESTS}); run the command that wrote it again rather than edit it"
        )


def read_json(path: str | os.PathLike) -> Any:
    """The JSON in ``path``; a file that is not JSON, or a result its folder's :data:`DIGESTS`
    book records other content for (an edited one), is a ``ValueError`` naming it (one line)."""
    data = Path(path).read_bytes()
    check_digest(path, data)
    try:
        return json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON ({exc})") from None


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary entry of this module's writers (``.{name}.*.tmp`` of
    :func:`atomic_write_bytes`, ``.tmp-{name}`` of :func:`atomic_directory`)."""
    return (name.startswith(".") and name.endswith(".tmp") and name.count(".") >= 3) or name.startswith(
        ".tmp-"
    )


def remove_stale_temporaries(root: str | os.PathLike) -> list[Path]:
    """Remove the temporary files and folders that killed writes left under ``root`` (at any
    depth); only for a folder this process owns (its lock held), where no write is under way.
    Returns what was removed."""
    removed = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*filenames, *dirnames]:
            if is_temporary(name):
                path = Path(dirpath) / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
        dirnames[:] = [d for d in dirnames if not is_temporary(d)]
    return removed


@contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Build the folder ``path`` under a temporary name (yielded), then rename it into place.

    Files go into the yielded folder with the ``atomic_write_*`` functions.  On success the
    temporary folder ``.tmp-{name}`` replaces ``path`` (an existing ``path`` is removed first); on
    an error it is removed and ``path`` is left as it was.  Stale ``.tmp-*`` folders beside
    ``path`` (killed writes) are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(".tmp-*"):  # left by a killed write
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".tmp-{path.name}"
    record_write(path, folder=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        write_event()
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except Exception:  # an interrupt, like a kill, leaves the .tmp-* folder for the next write
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)
