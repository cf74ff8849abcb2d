"""An index directory's files: each written whole or not at all, each read back checked.

A write (trainer/fsync.write_file) goes to a temporary name in the same directory, is fsynced, renamed
over its real name (os.replace) and the directory is fsynced, so a crash or a full disk leaves
the old file or the new one, never a 0-byte or half-written one under the real name (issue
"Nothing silent", case 4: a full disk left bm25's params.index.json at 0 bytes, a resumed build
took it for done and marked the index complete, and every load was a JSONDecodeError traceback).

A read that fails (not JSON, a truncated .npy, the wrong shape) is one DataError naming the file
and saying to rebuild the index; numpy's own "mmap length is greater than file size" names none.

    write_json(out / "meta.json", meta)
    save_npy(out / "spans.npy", spans)
    read_json(out / "meta.json")                                  # DataError naming it if corrupt
    load_npy(out / "spans.npy", shape=(n, 2), dtype=np.int64)     # mmap'd, shape checked
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainer.config import DataError
from trainer.fsync import write_file


def write_json(path: Path, data: dict) -> None:
    write_file(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))


def save_npy(path: Path, array: np.ndarray) -> None:
    write_file(path, lambda tmp: np.save(tmp, array))


def corrupt(path: Path, e: BaseException | str) -> DataError:
    """The one-line error for an index file that cannot be read back."""
    why = e if isinstance(e, str) else f"{type(e).__name__}: {' '.join(str(e).split()) or 'no detail'}"
    return DataError(f"index file {path} is corrupt or incomplete ({why[:300]}): rebuild the index")


def read_json(path: Path) -> dict:
    """A JSON object from an index file; unreadable, empty or not an object: DataError naming it."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise corrupt(path, "missing") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise corrupt(path, e) from None
    if not isinstance(data, dict):
        raise corrupt(path, f"a JSON {type(data).__name__}, not an object")
    return data


def load_npy(path: Path, shape: tuple | None = None, dtype=None, mmap: bool = True) -> np.ndarray:
    """A .npy array (mmap'd), checked against `shape` (None in it: any length) and `dtype`."""
    try:
        array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise corrupt(path, "missing") from None
    except (ValueError, OSError, EOFError) as e:  # numpy: "mmap length is greater than file size", ...
        raise corrupt(path, e) from None
    if shape is not None and (array.ndim != len(shape) or any(w not in (None, g) for w, g in zip(shape, array.shape))):
        raise corrupt(path, f"shape {array.shape}, expected {shape}")
    if dtype is not None and array.dtype != np.dtype(dtype):
        raise corrupt(path, f"dtype {array.dtype}, expected {np.dtype(dtype)}")
    return array
