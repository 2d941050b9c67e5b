"""FileStore: KV pages as files in a directory (the embedded default backend).

    <root>/index.sqlite3          entries(key, size, atime) + meta(bytes, clock): the LRU index
    <root>/data/<key[:2]>/<key>   one value per file

Invariants:
  - The index is the truth: a key is present iff it has a row. Rows and files change only inside an
    index write transaction (BEGIN IMMEDIATE, which SQLite serializes across processes), so several
    processes (or FileStore objects) on one directory see one consistent store.
  - A value is written to a private temp file first and renamed into place (atomic on POSIX), so a
    reader never sees a partial file; a row whose file vanished (crash, manual removal) is dropped
    and reads as a miss.
  - atime is a store-wide logical clock (meta 'clock'), so LRU order is exact across processes.
  - meta 'bytes' = sum of the rows' sizes. Each instance enforces its own capacity on its puts.
The directory must be local to one host (SQLite's WAL index needs shared memory; use Redis to share
KV across machines). No fsync: after a power loss a page may be garbage, which its CRC turns into a clear error/miss.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

from sglang_vericache.mem_cache.storage.base import KVStore, StoreError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, size INTEGER NOT NULL, atime INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS entries_atime ON entries (atime);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('bytes', 0), ('clock', 0);
"""


def _retry_locked(fn, timeout_s: float):
    """Run fn, retrying while SQLite reports the database locked. Switching a new index to WAL
    needs an exclusive lock and SQLite does not apply the busy timeout to it, so two processes
    opening one fresh directory at once would otherwise fail at once."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


class FileStore(KVStore):
    def __init__(self, root: str, capacity_bytes: int | None = None, timeout_s: float = 10.0):
        super().__init__(capacity_bytes)
        self.root = os.path.abspath(root)
        self.data_dir = os.path.join(self.root, "data")
        self._lock = threading.Lock()  # one sqlite connection per object, shared by its threads
        try:
            os.makedirs(self.data_dir, exist_ok=True)
            self._db = sqlite3.connect(os.path.join(self.root, "index.sqlite3"), timeout=timeout_s,
                                       isolation_level=None, check_same_thread=False)
            _retry_locked(lambda: self._db.execute("PRAGMA journal_mode=WAL"), timeout_s)
            self._db.execute("PRAGMA synchronous=NORMAL")
            with self._write():
                for stmt in filter(str.strip, _SCHEMA.split(";")):
                    self._db.execute(stmt)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"cannot open file KV store at {self.root}: {e}") from e

    def __repr__(self) -> str:
        return f"FileStore({self.root!r}, capacity_bytes={self.capacity_bytes})"

    # ---- helpers -----------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.data_dir, key[:2], key)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One index write transaction; backend failures surface as StoreError."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except (OSError, sqlite3.Error) as e:
                raise StoreError(f"file KV store {self.root}: {e}") from e

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"file KV store {self.root}: {e}") from e

    def _meta_add(self, db: sqlite3.Connection, name: str, delta: int) -> int:
        db.execute("UPDATE meta SET value = value + ? WHERE name = ?", (delta, name))
        return db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]

    def _drop(self, db: sqlite3.Connection, key: str, size: int) -> None:
        db.execute("DELETE FROM entries WHERE key = ?", (key,))
        self._meta_add(db, "bytes", -size)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    # ---- backend primitives ------------------------------------------------------------------
    def _put(self, key: str, data: bytes) -> int:
        final = self._path(key)
        tmp = os.path.join(os.path.dirname(final), f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
        except OSError as e:
            _unlink_quiet(tmp)
            raise StoreError(f"file KV store {self.root}: cannot write {tmp}: {e}") from e
        try:
            with self._write() as db:
                os.replace(tmp, final)
                old = db.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
                clock = self._meta_add(db, "clock", 1)
                db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", (key, len(data), clock))
                total = self._meta_add(db, "bytes", len(data) - (old[0] if old else 0))
                return self._evict(db, total, keep=key)
        finally:
            _unlink_quiet(tmp)

    def _evict(self, db: sqlite3.Connection, total: int, keep: str) -> int:
        cap = self.capacity_bytes
        if cap is None or total <= cap:
            return 0
        victims = []
        for key, size in db.execute("SELECT key, size FROM entries WHERE key != ? ORDER BY atime", (keep,)):
            if total <= cap:
                break
            victims.append((key, size))
            total -= size
        for key, size in victims:
            self._drop(db, key, size)
        return len(victims)

    def _get_prefix(self, keys: list[str]) -> list[bytes]:
        out: list[bytes] = []
        with self._write() as db:
            for key in keys:
                row = db.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
                if row is None:
                    break
                try:
                    with open(self._path(key), "rb") as f:
                        data = f.read()
                except FileNotFoundError:
                    self._drop(db, key, row[0])
                    break
                clock = self._meta_add(db, "clock", 1)
                db.execute("UPDATE entries SET atime = ? WHERE key = ?", (clock, key))
                out.append(data)
        return out

    def _count_prefix(self, keys: list[str]) -> int:
        present: set[str] = set()
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            marks = ",".join("?" * len(part))
            present.update(r[0] for r in self._read(f"SELECT key FROM entries WHERE key IN ({marks})", tuple(part)))
        n = 0
        while n < len(keys) and keys[n] in present:
            n += 1
        return n

    def _delete(self, key: str) -> bool:
        with self._write() as db:
            row = db.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
            if row is not None:
                self._drop(db, key, row[0])
            return row is not None

    # ---- public extras -----------------------------------------------------------------------
    def size_bytes(self) -> int:
        return self._read("SELECT value FROM meta WHERE name = 'bytes'")[0][0]

    def keys_lru(self) -> list[str]:
        return [r[0] for r in self._read("SELECT key FROM entries ORDER BY atime")]

    def clear(self) -> None:
        with self._write() as db:
            db.execute("DELETE FROM entries")
            db.execute("UPDATE meta SET value = 0 WHERE name = 'bytes'")
            shutil.rmtree(self.data_dir, ignore_errors=True)
            os.makedirs(self.data_dir, exist_ok=True)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
