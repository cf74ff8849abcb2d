"""Is the corpus still the one an index was built on, and are the index's own files still the ones
written (IndexFileGuard, below)? A digest recorded at build, checked at every load, and watched
while the index is in use (in process and by the server).

An index's rows are byte spans of its corpus file (corpus.py). A same-size edit after indexing
(two equal-length rows swapped) keeps every span a valid passage, and the 1,000 rows check_corpus
re-reads can miss it: the index then searches the old text and returns the new (issue "Nothing
silent", case 3: 'Kedez Tapet born' returned Pupo Bideru's passage). So a build (and
`retriever.py import`) records in meta.json:

    "corpus_digest": {"bytes": 14_000_000_000, "mtime_ns": ..., "ctime_ns": ..., "inode": ..., "device": ...,
                      "block_bytes": 4096, "blocks": 256, "sampled_blake2b": "9f1c...", "blake2b": "03ab..."}

`sampled_blake2b` hashes the size and 258 blocks of 4 KiB (the first, the last, 256 evenly spread
between): about 1 MiB read, a few ms. `blake2b` is the whole file's, computed while the build scans
every line anyway (no second read). What is caught, and when:

  * a change of size: at load, and at the next search or server request;
  * any edit of a corpus up to FULL_HASH_BYTES (64 MiB; 50 ms to hash): at load, which hashes it
    whole, and at the next search or request once the file's stat has changed;
  * an edit of a larger corpus that touches a sampled block: the same way;
  * any other edit of a larger corpus: by a whole-file hash run in a background thread (~1 s a
    GB) whenever the file's stat (device, inode, size, mtime, ctime) is not the build's; once it
    finds a difference every search raises CorpusChanged and the server answers 503. Searches
    made before it ends can return edited text: that window is the price of not reading wiki-18's
    14 GB before the first search. An unchanged stat skips this hash (the 8 ranks of a launch do
    not each read 14 GB): the kernel sets ctime on every write and no program can set it back.

Not caught: an edit of a large corpus in the same clock tick (~4 ms) as the stat taken at the
build's end that keeps the size and misses every sampled block; writes below the filesystem.
A file whose hashes are equal but whose mtime, ctime or inode changed is accepted: a copy, a
`touch` or a restore holds the same bytes. An index built before digests (no "corpus_digest") is
accepted with check_corpus's size and id checks, as before; its guard watches for changes from the
file as it was loaded.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from search.corpus import Corpus, scan_corpus
from trainer.config import DataError

FULL_HASH_BYTES = 64 * 2**20  # corpora up to this size are hashed whole at every check (~50 ms)
BLOCK_BYTES = 4096
SAMPLED_BLOCKS = 256  # besides the first and the last block
HASH_CHUNK = 2**20
STAT_FIELDS = ("bytes", "mtime_ns", "ctime_ns", "inode", "device")


class CorpusChanged(DataError):
    """A served file, the corpus or one of the index's own files, no longer holds what the index was
    built on (the server: 503)."""


def stat_key(st: os.stat_result) -> dict:
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}  # fmt: skip


def block_offsets(size: int, block: int = BLOCK_BYTES, blocks: int = SAMPLED_BLOCKS) -> list[int]:
    """Where the sampled blocks start: 0, size - block and `blocks` evenly spread between; every
    block when the file is no larger than that (the sampled hash then covers all of it).

    >>> block_offsets(10_000, block=4096, blocks=1)
    [0, 4096, 8192]
    >>> block_offsets(100_000, block=4096, blocks=2)
    [0, 31968, 63936, 95904]
    """
    if size <= (blocks + 2) * block:
        return list(range(0, size, block))
    last = size - block
    return [round(i * last / (blocks + 1)) for i in range(blocks + 2)]


def sampled_hash(fd: int, size: int, block: int = BLOCK_BYTES, blocks: int = SAMPLED_BLOCKS) -> str:
    h = hashlib.blake2b(str(size).encode(), digest_size=32)
    for at in block_offsets(size, block, blocks):
        h.update(os.pread(fd, block, at))
    return h.hexdigest()


def full_hash(fd: int, stop: Callable[[], bool] = lambda: False) -> str | None:
    """The whole file's blake2b; None if `stop()` turned true on the way (a newer check runs)."""
    h, at = hashlib.blake2b(digest_size=32), 0
    while chunk := os.pread(fd, HASH_CHUNK, at):
        h.update(chunk)  # releases the GIL: searches go on beside a background hash
        at += len(chunk)
        if stop():
            return None
    return h.hexdigest()


def file_digest(path: Path, whole: str = "") -> dict:
    """The digest of the file at `path` now: stat, sampled hash, and `whole` (its full hash) if given."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        digest = stat_key(st) | {"block_bytes": BLOCK_BYTES, "blocks": SAMPLED_BLOCKS,
                                 "sampled_blake2b": sampled_hash(fd, st.st_size)}  # fmt: skip
        if whole:
            digest["blake2b"] = whole
    finally:
        os.close(fd)
    return digest


def scan_with_digest(path: str | Path) -> tuple[Corpus, dict]:
    """scan_corpus, and the corpus's digest from the same pass. A file written while it was read
    is refused: the spans and the digest would describe two different files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    before = stat_key(os.stat(path))
    whole = hashlib.blake2b(digest_size=32)
    corpus = scan_corpus(path, whole.update)
    digest = file_digest(path, whole.hexdigest())
    if {k: digest[k] for k in STAT_FIELDS} != before:
        raise DataError(f"corpus {path} was written while it was being indexed; build again once it is complete")
    return corpus, digest


class CorpusGuard:
    """Watches a corpus file against the digest of the corpus an index was built on.

    `check()` costs a stat while the file is unchanged; a new stat (size, mtime, ctime, inode)
    means a new verification: size, sampled blocks, and the whole file's hash (at once up to
    FULL_HASH_BYTES, else in a background thread when the stat is not the build's). The verdict
    stays until the stat changes again: restoring the corpus clears it."""

    noun = "corpus"

    def __init__(self, path: str | Path, want: dict | None, index_dir: str | Path):
        self.path, self.index_dir = Path(path), Path(index_dir)
        self.since = "built" if want else "loaded"
        if not want:  # an index built before digests: check_corpus accepted the file; watch from here
            with open(self.path, "rb") as f:
                small = os.fstat(f.fileno()).st_size <= FULL_HASH_BYTES
                want = file_digest(self.path, full_hash(f.fileno()) if small else "")
        self.want = want
        self.seen: dict | None = None  # the stat of the file last verified
        self.fault: str | None = None  # why the file at that stat is not the indexed corpus
        self.generation = 0  # counts verifications: a background hash of an older one stops
        self.hashing: threading.Thread | None = None
        self.lock = threading.Lock()

    def check(self) -> None:
        """Raise CorpusChanged (one line) if the file no longer holds the indexed corpus."""
        why = self.reason()
        if why:
            raise CorpusChanged(why)

    def reason(self) -> str | None:
        """None while the file holds the indexed corpus (as far as checked yet), else why not."""
        # never raises: the server asks this inside its error handling, where an escaping
        # exception would end the worker that answers every /retrieve
        try:
            key = stat_key(os.stat(self.path))
            if key != self.seen:
                with self.lock:  # one thread verifies; the others wait for its verdict
                    if key != self.seen:
                        self.generation += 1
                        self.fault = self._verify(key, self.generation)
                        self.seen = key
        except OSError as e:  # gone or unreadable (between the stat and the open, too)
            return (f"{self.noun} {self.path} of index {self.index_dir} cannot be read ({e.strerror or e}): "
                    f"restore the {self.noun}")  # fmt: skip
        return self.fault

    def _changed(self, why: str) -> str:
        return (f"corpus {self.path} changed since index {self.index_dir} was {self.since} ({why}): "
                "rebuild the index, or restore the corpus")  # fmt: skip

    def _unhashed(self, key: dict) -> str | None:
        """A file too large to hash at every check, its stat not the build's, no whole hash recorded
        to compare: the sampled blocks were its only check (an index from before digests)."""
        return None

    def _verify(self, key: dict, generation: int) -> str | None:
        want = self.want
        if key["bytes"] != want["bytes"]:
            return self._changed(f"{key['bytes']} bytes, built on {want['bytes']}")
        with open(self.path, "rb") as f:  # what the path holds now (an edit may have replaced the file)
            fd = f.fileno()
            if sampled_hash(fd, key["bytes"], want["block_bytes"], want["blocks"]) != want["sampled_blake2b"]:
                return self._changed("sampled blocks differ")
            if "blake2b" not in want:
                return self._unhashed(key) if key["bytes"] > FULL_HASH_BYTES else None
            if key["bytes"] <= FULL_HASH_BYTES:
                if full_hash(fd) != want["blake2b"]:
                    return self._changed("its blake2b differs; the sampled blocks are equal")
            elif any(key[k] != want[k] for k in STAT_FIELDS):
                self.hashing = threading.Thread(target=self._hash_whole, args=(generation,), daemon=True,
                                                name="corpus-blake2b")  # fmt: skip
                self.hashing.start()
        return None

    def _hash_whole(self, generation: int) -> None:
        try:
            with open(self.path, "rb") as f:
                got = full_hash(f.fileno(), stop=lambda: self.generation != generation)
        except OSError:
            return  # gone or unreadable: the next check's stat says so
        if got is not None and got != self.want["blake2b"]:
            with self.lock:
                if self.generation == generation:
                    self.fault = self._changed("its blake2b differs; the sampled blocks are equal")

    def wait(self, timeout: float | None = None) -> None:
        """Until the background whole-file hash (if one runs) has its verdict."""
        if self.hashing is not None:
            self.hashing.join(timeout)


# --------------------------------------------------------------------------------------------
# The index's own files, watched as the corpus is.
#
# faiss.index (mmap'd, and for an import a hard link to the user's file), spans.npy and bm25's
# arrays (mmap'd) are served from their pages: a file rewritten in place changes the hits, and one
# cut short kills the process with SIGBUS at the next read of a page past its new end (measured:
# exit 135 on a Flat import cut to 4 KiB). So a build and an import record each file's digest in
# meta.json ("files"), load_index checks them, and the IndexGuard stats every one before each
# search and request: a changed size is refused before any page of the file is read (a 503, not a
# SIGBUS); a same-size rewrite as the corpus's is (hashes), or by its mtime (IndexFileGuard). What
# is left: a file cut short *during* a search, and, on a file over FULL_HASH_BYTES whose stat
# changed, the searches made before its background whole-file hash ends.


class IndexFileGuard(CorpusGuard):
    """One of an index's own files against its digest at the build (or import), checked as the
    corpus is. A file with no whole hash recorded (an imported faiss file over FULL_HASH_BYTES: the
    import does not read 65 GB) whose mtime is not the recorded one is refused whatever the sampled
    blocks say: the index never writes its files again once complete, so only a write (or a copy
    that did not keep the mtime) moved it. A chmod, a new hard link (ctime alone) or a copy that
    keeps the mtime (cp -a, rsync -a) is not a change."""

    noun = "index file"

    def __init__(self, path: str | Path, want: dict | None, index_dir: str | Path, since: str = "built"):
        super().__init__(path, want, index_dir)
        self.since = since if want else "loaded"

    def _changed(self, why: str) -> str:
        again = "import it again" if self.since == "imported" else "rebuild the index"
        return (f"index file {self.path} changed since index {self.index_dir} was {self.since} ({why}): "
                f"restore it, or {again}")  # fmt: skip

    def _unhashed(self, key: dict) -> str | None:
        if key["mtime_ns"] == self.want["mtime_ns"]:
            return None
        return self._changed("written since: its mtime is not the recorded one, and no whole hash was recorded "
                             "to compare")  # fmt: skip


def index_file_digests(index_dir: Path, names: list[str], sampled: tuple[str, ...] = ()) -> dict:
    """{name: digest} of an index's own files, for meta.json's "files": each hashed whole (a build
    has just written them: ~1 s a GB beside its hours of embedding), but the `sampled` ones over
    FULL_HASH_BYTES (an imported faiss file: the import reads none of its 65 GB)."""
    out = {}
    for name in names:
        path = index_dir / name
        with open(path, "rb") as f:
            small = os.fstat(f.fileno()).st_size <= FULL_HASH_BYTES
            whole = full_hash(f.fileno()) if small or name not in sampled else ""
        out[name] = file_digest(path, whole)
    return out


class IndexGuard:
    """Every file a loaded index serves from: its corpus (CorpusGuard) and its own files
    (IndexFileGuard each). `reason()` is the first fault found, `check()` raises it (CorpusChanged)."""

    def __init__(self, corpus: CorpusGuard, files: list[IndexFileGuard]):
        self.corpus, self.files = corpus, files

    @property
    def hashing(self) -> threading.Thread | None:  # the corpus's background whole-file hash
        return self.corpus.hashing

    def reason(self) -> str | None:
        # the index's files first: a size change there is refused before a page past the end is read
        for guard in [*self.files, self.corpus]:
            why = guard.reason()
            if why:
                return why
        return None

    def check(self) -> None:
        why = self.reason()
        if why:
            raise CorpusChanged(why)

    def wait(self, timeout: float | None = None) -> None:
        for guard in [self.corpus, *self.files]:
            guard.wait(timeout)
