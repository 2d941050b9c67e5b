"""FileStore specifics: atomic files, an index that survives removed files, several processes."""

from __future__ import annotations

import os
import subprocess
import sys

from sglang_vericache.mem_cache.storage.file_backend import FileStore

WRITER = """
import sys
from sglang_vericache.mem_cache.storage.file_backend import FileStore
root, tag = sys.argv[1], sys.argv[2]
s = FileStore(root, capacity_bytes=20_000)
for i in range(40):
    s.put(f"{tag}{i:03d}", bytes([i]) * 1000)
    s.get([f"{tag}{i // 2:03d}"])
"""


def data_files(root: str) -> dict[str, int]:
    out = {}
    for d, _, names in os.walk(os.path.join(root, "data")):
        out.update({n: os.path.getsize(os.path.join(d, n)) for n in names})
    return out


def test_put_leaves_exactly_one_file_per_key_and_no_temp_files(tmp_path):
    s = FileStore(str(tmp_path))
    s.put("abc", b"x" * 10)
    s.put("abc", b"y" * 20)
    s.put("abd", b"z" * 30)
    assert data_files(str(tmp_path)) == {"abc": 20, "abd": 30}


def test_a_value_whose_file_vanished_reads_as_a_miss_and_leaves_the_index(tmp_path):
    s = FileStore(str(tmp_path))
    s.put("k1", b"a" * 10)
    s.put("k2", b"b" * 10)
    os.unlink(os.path.join(str(tmp_path), "data", "k2", "k2"))
    assert s.get(["k1", "k2"]) == [b"a" * 10]
    assert (s.keys_lru(), s.size_bytes()) == (["k1"], 10)


def test_a_reopened_store_keeps_its_entries_and_lru_order(tmp_path):
    s = FileStore(str(tmp_path))
    for k in ("a1", "b1", "c1"):
        s.put(k, k.encode())
    s.get(["a1"])
    s.close()
    s = FileStore(str(tmp_path))
    assert s.keys_lru() == ["b1", "c1", "a1"]
    assert s.get(["c1"]) == [b"c1"]


def test_two_processes_writing_one_directory_keep_it_consistent(tmp_path):
    root = str(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, root, tag]) for tag in ("p", "q")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    s = FileStore(root)
    files = data_files(root)
    assert sorted(files) == sorted(s.keys_lru())
    assert s.size_bytes() == sum(files.values()) == 20_000
    assert all(s.get([k]) == [bytes([int(k[1:])]) * 1000] for k in files)
