"""L3 backends by name, for `--hicache-storage-backend` and its extra config."""
from __future__ import annotations

import importlib
import json

from ..storage import StorageBackend

BACKENDS = ("file", "redis", "mooncake", "dynamic")


def parse_extra_config(text: str | dict | None) -> dict:
    """`--hicache-storage-backend-extra-config`: a JSON object, or @path to a file
    holding one."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        return dict(text)
    src = "the extra config"
    if text.startswith("@"):
        src = text[1:]
        try:
            with open(src) as fh:
                text = fh.read()
        except OSError as e:
            raise ValueError(f"cannot read the storage extra config file {src}: {e}") from e
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{src} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{src} must be a JSON object, got {type(cfg).__name__}")
    return cfg


def make_backend(name: str, extra_config: str | dict | None = None) -> StorageBackend:
    """Build a backend by name. Only backend settings belong in `extra_config`; keys the
    tier itself reads (prefetch_threshold, prefetch timeouts) are taken out first."""
    cfg = {k: v for k, v in parse_extra_config(extra_config).items() if not k.startswith("prefetch_")}
    if name == "file":
        from .file import DEFAULT_DIR, FileBackend
        unknown = set(cfg) - {"path", "fsync"}
        if unknown:
            raise ValueError(f"file backend: unknown setting(s) {sorted(unknown)}; it takes path, fsync")
        return FileBackend(cfg.get("path", DEFAULT_DIR), cfg.get("fsync", False))
    if name == "redis":
        from .redis import RedisBackend
        return RedisBackend(**cfg)
    if name == "mooncake":
        from .mooncake import MooncakeBackend
        return MooncakeBackend(cfg)
    if name == "dynamic":
        return _dynamic(cfg)
    raise ValueError(f"unknown storage backend {name!r}; choose one of {', '.join(BACKENDS)}")


def _dynamic(cfg: dict) -> StorageBackend:
    """A user class: {"module_path": "pkg.mod", "class_name": "MyBackend", ...}; the
    other keys go to its constructor."""
    cfg = dict(cfg)
    try:
        module, cls_name = cfg.pop("module_path"), cfg.pop("class_name")
    except KeyError as e:
        raise ValueError(f"the dynamic backend needs {e.args[0]!r} in the extra config "
                         f"(module_path and class_name)") from None
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"dynamic backend: cannot load {module}.{cls_name}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ValueError(f"dynamic backend: {module}.{cls_name} is not a StorageBackend subclass")
    return cls(**cfg)
