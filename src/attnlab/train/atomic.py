"""Replacing a folder so that a crash at any instant leaves the complete old or the complete new.

Used by :func:`attnlab.train.checkpoint.save_checkpoint`.  For a destination ``DIR/NAME``::

    1. write      DIR/.NAME.tmp-PID-HEX/   a fresh sibling; every file and the folder fsynced
    2. (stale)    DIR/.NAME.old -> DIR/.NAME.trash-HEX, deleted   (left by a crash after 4)
    3. back up    DIR/NAME      -> DIR/.NAME.old                  rename(2)
    4. switch     DIR/.NAME.tmp-PID-HEX -> DIR/NAME               rename(2); the parent fsynced
    5. drop       DIR/.NAME.old -> DIR/.NAME.trash-HEX, deleted

``rename(2)`` within one folder is atomic, so ``NAME`` and ``.NAME.old`` are each, at every
instant, either absent or a complete folder, and once ``NAME`` has existed at least one
of the two is present.  A crash between 3 and 4 leaves only the backup: :func:`recover`
(which every save, load and :func:`~attnlab.train.checkpoint.latest_checkpoint` calls
first) renames it back, so readers always find the old or the new folder under ``NAME``.
Temporary folders of dead processes and trash are deleted by the next replace.  (This is
the rename-with-backup scheme; the directory entry ``NAME`` is briefly absent between 3
and 4, which is why readers go through :func:`recover`.)

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> def write(tmp, text):
...     (tmp / "a.txt").write_text(text)
>>> _ = replace_folder(root / "ck", lambda tmp: write(tmp, "old"))
>>> _ = replace_folder(root / "ck", lambda tmp: write(tmp, "new"))
>>> (root / "ck" / "a.txt").read_text(), sorted(p.name for p in root.iterdir())
('new', ['ck'])
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["replace_folder", "recover", "backup_path", "fsync_dir", "write_bytes", "check_writable_folder"]


def backup_path(dst: Path) -> Path:
    """Where :func:`replace_folder` keeps the previous folder while it switches (``.NAME.old``)."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.old"


def fsync_dir(d: Path) -> None:
    """Make the entries of folder ``d`` (renames, new files) durable.  Best effort: a
    platform that cannot open a folder (Windows) skips it."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(p: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``p`` (fsynced by :func:`replace_folder` afterwards)."""
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for d, _, files in os.walk(folder):
        for f in files:
            _fsync_file(Path(d) / f)
        fsync_dir(Path(d))


def _is_complete(folder: Path, marker: str | None) -> bool:
    return folder.is_dir() and not folder.is_symlink() and (marker is None or (folder / marker).is_file())


def recover(dst, marker: str | None = None) -> Path:
    """Undo an interrupted :func:`replace_folder`: if ``dst`` is missing and its backup
    (holding ``marker``, when given) is present, rename the backup back to ``dst``.

    Returns the folder to read: ``dst``, or the backup itself when it cannot be renamed
    (a read-only file system)."""
    dst = Path(dst)
    if os.path.lexists(dst):
        return dst
    bak = backup_path(dst)
    if not _is_complete(bak, marker):
        return dst
    try:
        os.replace(bak, dst)
    except FileNotFoundError:  # another process recovered it first
        return dst
    except OSError:
        return bak if _is_complete(bak, marker) else dst
    fsync_dir(dst.parent)
    return dst


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT there: assume alive
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _discard(p: Path, name: str) -> None:
    """Rename ``p`` to a trash name first (so a half-deleted folder never keeps a
    meaningful name), then delete it."""
    trash = p.parent / f".{name}.trash-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(p, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _clean_leftovers(dst: Path) -> None:
    """Delete temporary folders of ``dst`` left by processes that died, and its trash."""
    pattern = re.compile(re.escape(f".{dst.name}.") + r"(?:trash-[0-9a-f]{8}|tmp-(\d+)-[0-9a-f]{8})")
    try:
        entries = list(dst.parent.iterdir())
    except OSError:
        return
    for p in entries:
        m = pattern.fullmatch(p.name)
        if m is None:
            continue
        pid = m.group(1)
        if pid is None or (int(pid) != os.getpid() and not _pid_alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)


def replace_folder(dst, write: Callable[[Path], None], *, marker: str | None = None) -> Path:
    """Create or replace the folder ``dst`` with what ``write(tmp)`` puts into the empty
    folder ``tmp``; atomic at every instant as the module docstring describes.

    ``marker`` names a file a complete folder always holds (a backup without it is
    never restored).  If ``write`` raises, ``dst`` is unchanged and ``tmp`` is deleted."""
    dst = Path(dst)
    parent = dst.parent
    parent.mkdir(parents=True, exist_ok=True)
    recover(dst, marker)
    _clean_leftovers(dst)
    tmp = parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp, 0o755)
    try:
        write(tmp)
        _fsync_tree(tmp)
        bak = backup_path(dst)
        if os.path.lexists(bak):
            if not os.path.lexists(dst) and _is_complete(bak, marker):  # recover() could not rename it
                raise OSError(f"{dst}: missing, and its backup {bak} cannot be restored")
            _discard(bak, dst.name)  # stale (dst is complete), or the backup of an empty folder
        had_old = os.path.lexists(dst)
        if had_old:
            os.replace(dst, bak)  # same folder as the next rename: one fsync makes both durable
        os.replace(tmp, dst)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        recover(dst, marker)  # interrupted between 3 and 4: put the old folder back now
        raise
    if had_old:
        _discard(bak, dst.name)
    return dst


def check_writable_folder(path, what: str) -> Path:
    """Create ``path`` (and its parents) if needed and check that a file can be written
    in it, by writing and deleting one; ``ValueError`` naming ``what`` otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what}: {p} exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what}: cannot create the folder {p} ({e.strerror or e})") from None
    probe = p / f".attnlab-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_bytes(probe, b"")
    except OSError as e:
        raise ValueError(f"{what}: cannot write into the folder {p} ({e.strerror or e})") from None
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return p
