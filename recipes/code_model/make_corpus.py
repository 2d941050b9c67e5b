"""Collect the Python standard library sources of this interpreter into a train / held-out corpus.

Deterministic: files are sorted by relative path and split by a seeded hash of that path, so the
same Python version always yields the same corpus.  Writes `corpus_manifest.json` (Python version,
relative paths + sha256 for both splits) and `train.json` / `heldout.json` (a JSON list of file texts per split).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

# Directories skipped anywhere in the relative path.  Tests are skipped because much of them are
# fixtures (deliberately broken code, huge data literals); encodings/ and pydoc_data/ are data tables
# and generated help text rather than code.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data", "ensurepip"}
)
EXCLUDED_PREFIXES = ("_sysconfigdata",)  # generated build-configuration dicts
MAX_BYTES = 300_000  # no stdlib code file is larger; guards against generated blobs


def is_heldout(rel: str, seed: int, heldout_per_mille: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < heldout_per_mille


def collect(stdlib: Path) -> list[tuple[str, str]]:
    """Return sorted (relative path, text) pairs of the included .py files."""
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        parts = rel.split("/")
        if EXCLUDED_DIRS.intersection(parts[:-1]) or parts[-1].startswith(EXCLUDED_PREFIXES):
            continue
        data = path.read_bytes()
        if len(data) > MAX_BYTES:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((rel, text))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("recipes/code_model/work"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-per-mille", type=int, default=40)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = collect(stdlib)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    for rel, text in files:
        splits["heldout" if is_heldout(rel, args.seed, args.heldout_per_mille) else "train"].append(
            (rel, text)
        )

    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib": str(stdlib),
        "seed": args.seed,
        "heldout_per_mille": args.heldout_per_mille,
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "excluded_prefixes": list(EXCLUDED_PREFIXES),
        "max_bytes": MAX_BYTES,
    }
    for name, items in splits.items():
        manifest[name] = {
            "num_files": len(items),
            "num_bytes": sum(len(t.encode()) for _, t in items),
            "files": [{"path": rel, "sha256": hashlib.sha256(t.encode()).hexdigest()} for rel, t in items],
        }
        # One JSON list of file texts per split keeps file boundaries exact for tokenization.
        (args.out / f"{name}.json").write_text(json.dumps([t for _, t in items]))
    (args.out / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"python {manifest['python_version']} ({sys.executable}): "
        f"train {manifest['train']['num_files']} files / {manifest['train']['num_bytes']} bytes, "
        f"heldout {manifest['heldout']['num_files']} files / {manifest['heldout']['num_bytes']} bytes"
    )


if __name__ == "__main__":
    main()
