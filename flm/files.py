"""Files written whole or not at all (a temporary file, then a rename), and one clear line when the disk
is full or the folder read-only: the temporary file is removed and the earlier files stay intact."""

import contextlib
import errno
import json
import os
import shutil
import uuid

# OSErrors that say where the fault is (the disk, the folder's permissions), not the program.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


class DiskError(OSError):
    """A write that failed because of the disk or the folder; its message says which and what to do."""

    def __str__(self) -> str:
        return self.strerror


def write_atomically(path: str, write, *, needed_bytes: int | None = None, tmp_suffix: str = ".tmp") -> None:
    """write(tmp) for a temporary file next to `path`, then rename it to `path`. On any failure the
    temporary file is removed; a full disk or an unwritable folder raises disk_error's DiskError.

    needed_bytes: about what the file takes, to name the space needed and to recognise a full disk
    behind writers that do not say so (torch.save reports it as a RuntimeError).
    """
    folder = os.path.dirname(os.path.abspath(path))
    # a name of its own: two processes writing the same file (ranks or jobs sharing a reference-statistics cache)
    # must not write into one temporary file, or rename it from under each other
    tmp = f"{path}.{uuid.uuid4().hex[:12]}{tmp_suffix}"
    try:
        os.makedirs(folder, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        error = disk_error(e, path, needed_bytes)
        if error is None:
            raise
        raise error from None


def write_json(path: str, obj) -> None:
    """`obj` as indented JSON at `path`, through write_atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)

    write_atomically(path, write)


def disk_error(e: BaseException, path: str, needed_bytes: int | None) -> DiskError | None:
    """The one-line OSError behind a failed write of `path` when the disk is full or the folder not
    writable; None when the failure is something else."""
    folder = existing_parent(os.path.dirname(os.path.abspath(path)))
    code = e.errno if isinstance(e, OSError) else None
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return DiskError(
            code,
            f"cannot write {path!r}: {os.strerror(code)} in {folder!r}; make the folder writable "
            f"or write elsewhere (run_dir=... for train.py, out=... for sample.py)",
        )
    free = shutil.disk_usage(folder).free
    if code in (errno.ENOSPC, errno.EDQUOT) or (needed_bytes is not None and free < needed_bytes):
        need = f"about {_size(needed_bytes)}" if needed_bytes is not None else "more"
        return DiskError(
            errno.ENOSPC,
            f"disk full: writing {path!r} on {mount_point(folder)!r} needs {need}, "
            f"{_size(free)} free; nothing was written and earlier files are intact. "
            f"Free some space there or write elsewhere",
        )
    return None


def existing_parent(path: str) -> str:
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def mount_point(path: str) -> str:
    """The mount point of the disk that holds `path`."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------
# One process per run folder
# ----------------------------------------------------------------------------------------------

LOCK_NAME = ".lock"
_HELD: dict[str, int] = {}  # folder -> the open lock file of this process


def lock_folder(folder: str) -> None:
    """Hold an exclusive lock on `folder` (its .lock file, with this process's id) until unlock_folder or
    the process ends; another process holding it is refused at once. Held already by this process: no-op."""
    folder = os.path.abspath(folder)
    if folder in _HELD:
        return
    import fcntl

    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(
            f"run folder {folder!r} is in use by another run (process {holder} holds "
            f"{os.path.join(folder, LOCK_NAME)}); wait for it to end or choose another run_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD[folder] = fd


def unlock_folder(folder: str) -> None:
    fd = _HELD.pop(os.path.abspath(folder), None)
    if fd is not None:
        os.close(fd)  # the file stays: removing it could let two processes lock two different files
