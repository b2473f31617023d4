"""Where a converted checkpoint is written: checked before the conversion reads anything, staged in a
temporary folder beside it, renamed into place when complete, and never left half-written.

- :func:`check_destination` runs first: DST must not exist (or, to be replaced, be a checkpoint of ours
  or an empty folder: ``--overwrite`` never deletes a folder of something else), and the nearest existing
  folder above it must be a folder that we can create entries in (tried with a probe folder, since
  permission bits say nothing for root or on read-only mounts).
- :func:`staging` gives the temporary folder ``.DST.tmp-<host>-<pid>-<random>``. It is removed when the
  write fails, raises, or the process gets SIGTERM/SIGHUP (turned into ``SystemExit`` while staging, so the
  cleanup runs). A process killed outright (SIGKILL, power loss) cannot clean up; the next conversion to
  the same DST removes what it left: temporary folders whose owner process on this host is gone (and
  those named by jaxdit before owners were recorded, ``.DST.tmp-<12 hex>``). A replaced old DST, parked as
  ``.DST.old-<host>-<pid>-<random>`` for the instant between two renames, is put back if its owner died
  before the new DST was in place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from converters.errors import DestinationError

__all__ = ["check_destination", "short_reason", "staging", "sweep", "write_error"]

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_LEGACY_TMP = re.compile(r"tmp-[0-9a-f]{12}")
_OWNED = re.compile(r"(tmp|old)-([0-9a-f]{8})-(\d+)-[0-9a-f]{12}")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_destination(
    dst: str | os.PathLike[str], *, overwrite: bool, is_ours: Callable[[Path], bool]
) -> Path:
    """Raise before any work if ``dst`` cannot be written (see the module docstring); returns it absolute.

    ``FileExistsError`` when it exists and ``overwrite`` is False; :class:`DestinationError` otherwise.
    What killed conversions to ``dst`` left is swept first (:func:`sweep`), so a parked old checkpoint
    that is put back counts as existing.
    """
    dst = Path(dst).absolute()
    sweep(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it")
        empty_dir = dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())
        if not (is_ours(dst) or empty_dir):
            kind = "file" if dst.is_file() else "folder"
            raise DestinationError(
                f"{dst} exists and is a {kind} that is not a jaxdit checkpoint; --overwrite replaces only "
                "converted checkpoints (or an empty folder): remove it yourself or choose another path"
            )
    parent = _nearest_existing(dst.parent)
    if not parent.is_dir():
        raise DestinationError(f"cannot write {dst}: {parent} is a file, not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=f".{dst.name}.probe-", dir=parent)
    except OSError as e:
        raise DestinationError(
            f"cannot write {dst}: cannot create anything in {parent} ({e.strerror or e})"
        ) from None
    os.rmdir(probe)
    return dst


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep(dst: Path) -> list[Path]:
    """Remove what killed conversions to ``dst`` left beside it; returns what was removed or restored."""
    prefix = f".{dst.name}."
    done = []
    if not dst.parent.is_dir():
        return done
    for entry in dst.parent.iterdir():
        if not entry.name.startswith(prefix):
            continue
        tag = entry.name[len(prefix) :]
        owned = _OWNED.fullmatch(tag)
        if owned:
            kind, host, pid = owned.group(1), owned.group(2), int(owned.group(3))
            if host != _HOST or _alive(pid):
                continue  # another host's (cannot tell) or a conversion still running
        elif _LEGACY_TMP.fullmatch(tag):
            kind = "tmp"
        else:
            continue
        if kind == "old" and not dst.exists():
            # The owner died between moving the old DST aside and moving the new one in: put it back.
            with contextlib.suppress(OSError):
                os.rename(entry, dst)
                done.append(entry)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        done.append(entry)
    return done


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit while staging (so the temporary folder is removed), where they
    still have their default action and we are on the main thread (the only one that may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def staging(dst: Path, *, overwrite: bool) -> Iterator[Path]:
    """A fresh temporary folder beside ``dst`` (checked by :func:`check_destination`); renamed to ``dst``
    when the block ends without an exception (replacing it only with ``overwrite``), removed otherwise."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(dst, e) from None
    owner = f"{_HOST}-{os.getpid()}-{secrets.token_hex(6)}"
    tmp = dst.parent / f".{dst.name}.tmp-{owner}"
    with _signals_raise():
        try:
            tmp.mkdir()
            yield tmp
            if (dst.exists() or dst.is_symlink()) and not overwrite:  # appeared while we converted
                raise FileExistsError(f"{dst} appeared while converting; pass --overwrite to replace it")
            if dst.exists() or dst.is_symlink():
                old = dst.parent / f".{dst.name}.old-{owner}"
                os.rename(dst, old)
                os.rename(tmp, dst)
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink()
            else:
                os.rename(tmp, dst)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(
                e, FileExistsError
            ):  # mkdir or rename: a permission, space or filesystem problem
                raise write_error(dst, e) from None
            raise


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left", "RESOURCE_EXHAUSTED", "quota exceeded")
_TOO_LARGE = (errno.EFBIG,)
_TOO_LARGE_TEXT = ("File too large",)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def short_reason(error: BaseException, limit: int = 240) -> str:
    """An error's message on one line, at most ``limit`` characters: tensorstore's name the file in the
    middle and the cause (e.g. "No space left on device") at the end, so both ends are kept."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5) :]}"


def write_error(dst: Path, error: BaseException, nbytes: int | None = None) -> DestinationError:
    """A failed write as one line: the destination, the reason and, for a full disk, the sizes."""
    chain, e = [], error
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(c) for c in chain)
    errnos = {getattr(c, "errno", None) for c in chain}
    reason = short_reason(chain[-1])
    if errnos & set(_TOO_LARGE) or any(t in text for t in _TOO_LARGE_TEXT):
        return DestinationError(
            f"cannot write {dst}: a file grew past the size limit (the filesystem's, or the shell's "
            f"`ulimit -f`); nothing was written ({reason})"
        )
    if errnos & set(_NO_SPACE) or any(t in text for t in _NO_SPACE_TEXT):
        free = shutil.disk_usage(_nearest_existing(dst.parent)).free
        need = f"the parameters take {_size(nbytes)} before compression; " if nbytes else ""
        return DestinationError(
            f"cannot write {dst}: no space left ({need}{_size(free)} free there); nothing was written "
            f"({reason})"
        )
    return DestinationError(f"cannot write {dst}: {reason}; nothing was written")
