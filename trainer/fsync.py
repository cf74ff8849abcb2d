"""Writes that survive a crash, a full disk or a power cut: a file is written under a temporary
name, fsynced, renamed over its real name and its directory fsynced (write_file: an index's files,
a run's config.yaml, prepare_data.py's parquets); a checkpoint directory is fsynced file by file
before it is renamed into place (fsync_tree). A reader sees the old file or the new one, never a
0-byte or half-written one under the real name.

    write_file(path, lambda tmp: tmp.write_text(text))
    fsync_tree(tmp_dir); os.replace(tmp_dir, final_dir); fsync_path(final_dir.parent)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (network mounts) cannot fsync a directory: nothing to flush there
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory`, then each directory (deepest first), so a checkpoint
    renamed into place after this holds its data even after a power cut: without it the rename
    can reach the disk before the files' contents, leaving a step_<k> of empty or short files."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def building_name(path: Path) -> Path:
    """The temporary name `path` is written under: same directory (os.replace is atomic only within
    one filesystem), same suffix (np.save appends .npy to a name without it), hidden by a dot."""
    return path.with_name(f".building-{path.name}")


def write_file(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes the file's bytes at a temporary path; it then replaces `path` whole."""
    tmp = building_name(path)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk gets its space back
        raise
    fsync_path(path.parent)  # the rename itself survives a power cut
