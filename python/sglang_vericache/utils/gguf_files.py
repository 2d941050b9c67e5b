"""GGUF checkpoints (llama.cpp's one-file format): find the file, check it, and keep what transformers
converts from it in a cache folder, so only the first start pays for the conversion.

The cache folder, `$XDG_CACHE_HOME/sglang_vericache/gguf/<file stem>-<key>/` (default
`~/.cache/sglang_vericache/gguf/...`, keyed by the file's path, size and mtime), holds:
- config.json, generation_config.json: transformers' config for the file (`AutoConfig.from_pretrained(
  folder, gguf_file=...)`) plus `architectures` and `dtype` (float32 for an all-F32 file, else bfloat16);
- tensors.json: the file's tensor table (name, ggml type, shape, byte range), so the weight loader need
  not parse the metadata again (gguf's GGUFReader spends seconds on a 262K-token vocabulary);
- tokenizer.json, tokenizer_config.json, chat_template.jinja: the tokenizer transformers builds from the
  file (`AutoTokenizer.from_pretrained(folder, gguf_file=...)`, ~10 s), with its chat template.
Each part is built under its own file lock (the scheduler and the tokenizer manager start together),
in a scratch folder, and moved in with its marker file last, so a crash never leaves half a cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# general.architecture values we serve (llama.cpp writes Mistral checkpoints as "llama")
SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")
# ggml tensor types the loader dequantizes (through gguf.quants.dequantize)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
CACHE_VERSION = 1  # in the cache key: a change to what the cache holds gets new folders
TENSORS_FILE = "tensors.json"
CONFIG_MARKER = "config.json"  # moved in last: the config part is complete
TOKENIZER_MARKER = "tokenizer_config.json"  # moved in last: the tokenizer part is complete


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: where its bytes are and how they are stored."""

    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    ggml_type: str  # GGMLQuantizationType name, e.g. Q4_K
    shape: tuple[int, ...]  # torch order (rows first)
    offset: int  # from the start of the file
    n_bytes: int


def gguf_file_of(path: str) -> str | None:
    """The GGUF file `--model-path` names: the path itself if it is a file, the one *.gguf of a folder
    without config.json; None for a Hugging Face folder (or a path that does not exist)."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(files) > 1:
        names = [os.path.basename(f) for f in files]
        raise ValueError(f"model folder {path!r} holds {len(files)} GGUF files {names}: pass one of them "
                         f"as --model-path (split multi-file GGUF checkpoints are not supported)")
    return files[0] if files else None


def check_magic(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file (it starts with {head!r}, a GGUF file with "
                         f"{GGUF_MAGIC!r}); --model-path takes a .gguf file or a Hugging Face model folder")


def read_tensor_table(path: str) -> tuple[str, list[TensorEntry]]:
    """(general.architecture, tensor table) through gguf.GGUFReader, with a clear error for a truncated
    or damaged file, an architecture or a tensor type we do not serve."""
    from gguf import GGUFReader

    check_magic(path)
    size = os.path.getsize(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # cut short or damaged: numpy/struct errors that name no file
        raise ValueError(f"{path!r} is truncated or damaged: gguf cannot read it from its {size} bytes "
                         f"({type(e).__name__}: {e}); download or copy it again") from e
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path!r}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (llama covers Mistral)")
    table = [TensorEntry(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                         int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    check_tensor_table(path, table, size)
    if any(t.name == "rope_freqs.weight" for t in table):
        raise ValueError(f"{path!r} scales RoPE by a rope_freqs tensor (Llama 3.1-style rope scaling), which "
                         f"transformers' GGUF config leaves out: it would run with the wrong rotary "
                         f"frequencies; serve the Hugging Face checkpoint instead")
    return arch, table


def check_tensor_table(path: str, table: list[TensorEntry], size: int) -> None:
    bad = sorted({t.ggml_type for t in table} - set(SUPPORTED_TYPES))
    if bad:
        names = [t.name for t in table if t.ggml_type in bad][:4]
        raise ValueError(f"{path!r} holds tensors of type {', '.join(bad)} (e.g. {names}), which this server "
                         f"cannot dequantize; supported: {', '.join(SUPPORTED_TYPES)}")
    end = max((t.offset + t.n_bytes for t in table), default=0)
    if end > size:
        last = max(table, key=lambda t: t.offset + t.n_bytes).name
        raise ValueError(f"{path!r} is truncated: its tensors need {end} bytes ({last} ends there) but the "
                         f"file has {size} (an interrupted download or copy?)")


# ---- the cache folder ---------------------------------------------------------------------------

def cache_root() -> str:
    from sglang_vericache.utils.default_model import cache_dir as vericache_cache

    return str(vericache_cache() / "gguf")


def cache_dir(gguf_path: str) -> str:
    """This file's cache folder: a new file (other path, size or mtime) gets a new one."""
    st = os.stat(gguf_path)
    real = os.path.realpath(gguf_path)
    key = hashlib.sha256(f"{CACHE_VERSION}\0{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), f"{stem}-{key}")


@contextlib.contextmanager
def _locked(folder: str, part: str) -> Iterator[None]:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f".{part}.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting the GGUF %s into %s", part, folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # the lock goes with the file


def _move_in(scratch: str, folder: str, last: str) -> None:
    names = sorted(os.listdir(scratch), key=lambda n: n == last)  # the marker file last
    for name in names:
        os.replace(os.path.join(scratch, name), os.path.join(folder, name))


def _build_once(folder: str, part: str, marker: str, build: Callable[[str], None]) -> str:
    """folder, with `part` built once across processes: build(scratch) writes it into a scratch folder
    under a file lock, and it is moved in with `marker` last (a folder holding the marker is complete)."""
    if os.path.isfile(os.path.join(folder, marker)):
        return folder
    with _locked(folder, part):
        if os.path.isfile(os.path.join(folder, marker)):
            return folder
        scratch = tempfile.mkdtemp(prefix=f".{part}-", dir=folder)
        try:
            build(scratch)
            _move_in(scratch, folder, marker)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder


def ensure_config(gguf_path: str) -> str:
    """The cache folder of `gguf_path` with config.json, generation_config.json and tensors.json."""
    folder = cache_dir(gguf_path)

    def build(scratch: str) -> None:
        t0 = time.perf_counter()
        logger.info("loading GGUF %s: reading its metadata into %s (first start only)", gguf_path, folder)
        arch, table = read_tensor_table(gguf_path)
        with open(os.path.join(scratch, TENSORS_FILE), "w") as f:
            json.dump({"architecture": arch, "tensors": [asdict(t) for t in table]}, f)
        _write_hf_config(gguf_path, table, scratch)
        logger.info("loading GGUF %s: config cached in %.1f s", gguf_path, time.perf_counter() - t0)

    return _build_once(folder, "config", CONFIG_MARKER, build)


def _write_hf_config(gguf_path: str, table: list[TensorEntry], out: str) -> None:
    """transformers' config for the file, completed with what it leaves out: `architectures` (the causal-LM
    class of its model_type), `dtype` and, where the file states it, `head_dim` (attention.key_length)."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder, name = os.path.split(os.path.abspath(gguf_path))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    weight_types = {t.ggml_type for t in table if len(t.shape) > 1}
    config.dtype = "float32" if weight_types <= {"F32"} else "bfloat16"
    meta = _scalar_metadata(gguf_path)
    arch = meta["general.architecture"]
    if (key_length := meta.get(f"{arch}.attention.key_length")) is not None:
        config.head_dim = int(key_length)  # transformers reads it for gemma only; Qwen3 files carry it too
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    # llama.cpp stops on every end-of-generation token: eos, end-of-turn, end-of-message
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    if len(set(eos)) > 1:
        generation.eos_token_id = sorted(set(eos))
    generation.save_pretrained(out)


def _scalar_metadata(gguf_path: str) -> dict:
    """The file's scalar metadata (arrays skipped), through transformers' fast header reader."""
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(gguf_path)
    return {k: v for k, v in metadata.items() if isinstance(v, (int, float, str))}


def load_tensor_table(folder: str) -> tuple[str, list[TensorEntry]]:
    with open(os.path.join(folder, TENSORS_FILE)) as f:
        data = json.load(f)
    return data["architecture"], [TensorEntry(t["name"], t["ggml_type"], tuple(t["shape"]), t["offset"],
                                              t["n_bytes"]) for t in data["tensors"]]


def ensure_tokenizer(gguf_path: str) -> str:
    """The cache folder of `gguf_path` with the tokenizer transformers builds from the file."""

    def build(scratch: str) -> None:
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        logger.info("loading GGUF %s: converting its tokenizer (first start only, ~10 s)", gguf_path)
        src_folder, name = os.path.split(os.path.abspath(gguf_path))
        tokenizer = AutoTokenizer.from_pretrained(src_folder, gguf_file=name)
        add_bos = _scalar_metadata(gguf_path).get("tokenizer.ggml.add_bos_token")
        if add_bos is not None and bool(add_bos) != tokenizer.add_bos_token:
            tokenizer.add_bos_token = bool(add_bos)  # the file's flag, as llama.cpp honours it (transformers not)
        tokenizer.save_pretrained(scratch)
        logger.info("loading GGUF %s: tokenizer cached (%.1f s)", gguf_path, time.perf_counter() - t0)

    return _build_once(ensure_config(gguf_path), "tokenizer", TOKENIZER_MARKER, build)
