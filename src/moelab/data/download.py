"""Fetch a file once into the cache, verify its sha256, and fail offline with a message that says
what to fetch and where to put it.

The cache is ``$MOELAB_DATA`` (default ``~/.cache/moelab``).  Every data loader goes through
:func:`fetch`, so downloads are verified and atomic everywhere.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ..errors import DataError

__all__ = ["DataError", "cache_dir", "fetch", "sha256sum", "verified"]


def cache_dir() -> Path:
    """``$MOELAB_DATA`` or ``~/.cache/moelab``."""
    return Path(os.environ.get("MOELAB_DATA") or Path.home() / ".cache" / "moelab")


def sha256sum(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verified(path: Path, size: int | None = None) -> Path:
    """Check an extracted file's size and its recorded sha256 (recorded on first use)."""
    if size is not None and path.stat().st_size != size:
        raise DataError(
            f"{path} has {path.stat().st_size} bytes, expected {size}: the file is truncated or not the "
            f"right one; delete it (and its .zip) and run again to re-download"
        )
    record = path.with_name(path.name + ".sha256")
    digest = sha256sum(path, 1 << 22)
    if record.exists():
        expected = record.read_text().split()[0]
        if expected != digest:
            raise DataError(
                f"{path} has sha256 {digest}, but {expected} was recorded when it was first extracted: "
                f"the file changed or is corrupted; delete it and run again"
            )
    else:
        record.write_text(f"{digest}  {path.name}\n")
    return path


def fetch(
    name: str,
    urls: str | Sequence[str],
    sha256: str | None,
    subdir: str = "",
    timeout: float = 30.0,
    progress: bool = True,
) -> Path:
    """Return the cached path of ``name``, downloading it first if needed.

    Args:
        name: file name in the cache.
        urls: the canonical source, then mirrors, tried in order.
        sha256: expected hex digest; a cached or downloaded file that does not match is refused
            (a cached one is deleted and fetched again).  ``None`` skips the check (avoid).
        subdir: folder under the cache.

    Raises:
        DataError: no URL could be reached (offline), or the checksum does not match.
    """
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise ValueError(f"urls={urls!r} is not allowed; expected at least one URL")
    for url in urls:  # what is fetched over the network is fetched over TLS
        if not isinstance(url, str) or not url.startswith(("https://", "file:")):
            raise ValueError(f"url={url!r} is not allowed; expected an https:// (or file:) URL")
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"name={name!r} is not allowed; expected a plain file name (no folders)")
    if sha256 is not None:  # a malformed digest would refuse (and delete) every good download
        if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
            raise ValueError(f"sha256={sha256!r} is not allowed; expected 64 hexadecimal digits or None")
        sha256 = sha256.lower()
    dest = cache_dir() / subdir / name
    if dest.exists():
        if sha256 is None or sha256sum(dest) == sha256:
            return dest
        dest.unlink()  # corrupted or tampered: fetch again
    dest.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for url in urls:
        try:
            _download(url, dest, timeout=timeout, progress=progress)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            errors.append(f"{url}: {exc}")
            continue
        if sha256 is not None and (got := sha256sum(dest)) != sha256:
            dest.unlink()
            raise DataError(
                f"{name} downloaded from {url} has sha256 {got}, expected {sha256}: the file is corrupted or "
                f"has changed upstream; download it by hand and place it at {dest}"
            )
        return dest
    raise DataError(
        f"cannot download {name} (offline?): tried {'; '.join(errors)}. Fetch it from {urls[0]} and place it at "
        f"{dest} (or set MOELAB_DATA to a folder that holds {Path(subdir) / name})"
    )


def _download(url: str, dest: Path, timeout: float, progress: bool) -> None:
    from tqdm.auto import tqdm

    with urllib.request.urlopen(url, timeout=timeout) as response:
        total = int(response.headers.get("Content-Length") or 0) or None
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with (
                os.fdopen(fd, "wb") as f,
                tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=not progress) as bar,
            ):
                while block := response.read(1 << 20):
                    f.write(block)
                    bar.update(len(block))
                f.flush()
                os.fsync(f.fileno())
            shutil.move(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
