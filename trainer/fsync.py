"""Flushing to the disk what must survive a power cut: a checkpoint (trainer/checkpoint.py) and
an index (search/files.py) are fsynced, file by file, before they are renamed into place, and the
directory after the rename.

    fsync_tree(tmp_dir); os.replace(tmp_dir, final_dir); fsync_path(final_dir.parent)
"""

from __future__ import annotations

import errno
import os
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
