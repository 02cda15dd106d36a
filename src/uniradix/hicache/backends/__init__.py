"""L3 backends by name, for `--hicache-storage-backend` and its extra config, and the
one builder that opens one for a start (`open_backend`: built, then its store reached).

Every mistake in the extra config is a one-line ValueError that names the backend and
the setting and says what is expected: a start-up error, never a traceback. So is a
store that cannot be reached at start-up (StorageUnavailable), unless the extra config
says `"allow_unavailable_at_start": true`."""
from __future__ import annotations

import importlib
import inspect
import logging
import math

from ...config import STORAGE_BACKENDS, StorageConfig, parse_extra_config
from ..io_threads import DaemonThreads, call_within
from ..storage import StorageBackend, StorageUnavailable

log = logging.getLogger("uniradix.hicache")

BACKENDS = STORAGE_BACKENDS

# Extra-config keys the storage tier reads itself (config.StorageConfig checks them);
# make_backend leaves them out of the backend's settings.
TIER_KEYS = StorageConfig.tier_keys()


def open_backend(settings: StorageConfig) -> StorageBackend:
    """The backend `settings` name (hicache_storage_backend and its extra config), its
    store reached once before anything serves: the one builder of `uniradix run`,
    `uniradix serve` and `Engine(hicache_storage_backend=...)`. A store that cannot be
    reached within io_timeout is StorageUnavailable (one line naming it, secrets masked
    by the backend's own messages), so that a start never goes on with L3 silently off,
    unless `allow_unavailable_at_start` says it may come later: then a warning, and
    every call fails, counted, until it answers (as when a store goes away later)."""
    if not settings.hicache_storage_backend:
        raise ValueError("no storage backend is named (hicache_storage_backend)")
    backend = make_backend(settings.hicache_storage_backend, settings.backend_settings())
    try:
        _probe(backend, settings.io_timeout)
    except StorageUnavailable as e:
        if settings.allow_unavailable_at_start:
            log.warning("%s; L3 calls fail until it answers (allow_unavailable_at_start)", e)
            return backend
        call_within(backend.close, settings.io_timeout)
        raise StorageUnavailable(f"{' '.join(str(e).split())} (at start-up; to start without it and use it "
                                 f'once it answers, add "allow_unavailable_at_start": true to '
                                 f"--hicache-storage-backend-extra-config)") from None
    return backend


def _probe(backend: StorageBackend, timeout: float) -> None:
    """backend.probe() on a daemon thread, waited for at most `timeout` seconds (a store
    that never answers must not hold the start for good); whatever it raises is the
    store unavailable."""
    threads = DaemonThreads(1, "uniradix-probe")
    fut = threads.submit(backend.probe)
    try:
        fut.result(timeout=timeout)
    except TimeoutError:
        raise StorageUnavailable(f"{backend.name} backend: the store did not answer within io_timeout "
                                 f"({timeout:g} s)") from None
    except StorageUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - a user backend's probe failing is the store unreachable
        raise StorageUnavailable(f"{backend.name} backend: reaching the store failed: {_one_line(e)}") from None
    finally:
        threads.shutdown()


def make_backend(name: str, extra_config: str | dict | None = None) -> StorageBackend:
    """Build a backend by name from its settings in `extra_config` (TIER_KEYS, the
    tier's own, are left out). Any configuration mistake is a ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"unknown storage backend {name!r}; choose one of {', '.join(BACKENDS)}")
    cfg = {k: v for k, v in parse_extra_config(extra_config).items() if k not in TIER_KEYS}
    if name == "file":
        from .file import SETTINGS, FileBackend
        unknown = set(cfg) - set(SETTINGS)
        if unknown:
            raise ValueError(f"file backend: unknown setting(s) {sorted(unknown)}; it takes "
                             f"{', '.join(SETTINGS)}")
        return FileBackend(**cfg)
    if name == "redis":
        from .redis import RedisBackend
        return RedisBackend(**cfg)
    if name == "mooncake":
        from .mooncake import MooncakeBackend
        return MooncakeBackend(cfg)
    return _dynamic(cfg)


def _check_finite(cfg: dict) -> None:
    """Python's json reads NaN and Infinity, which no setting means. The built-in
    backends check each setting's type and range; a user class may not, so for it they
    are refused here (nested values included)."""
    def walk(v):
        if isinstance(v, float) and not math.isfinite(v):
            return v
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return next((bad for x in items if (bad := walk(x)) is not None), None)

    for k, v in cfg.items():
        bad = walk(v)
        if bad is not None:
            raise ValueError(f"dynamic backend: setting {k!r} must be a finite number, got {bad!r}")


def _dynamic(cfg: dict) -> StorageBackend:
    """A user class: {"module_path": "pkg.mod", "class_name": "MyBackend", ...}; the
    other keys go to its constructor, checked against its signature first."""
    cfg = dict(cfg)
    for k in ("module_path", "class_name"):
        if k not in cfg:
            raise ValueError(f"the dynamic backend needs {k!r} in the extra config "
                             f"(module_path and class_name)")
        if not isinstance(cfg[k], str) or not cfg[k]:
            raise ValueError(f"dynamic backend: {k} must be a non-empty string, got {cfg[k]!r}")
    module, cls_name = cfg.pop("module_path"), cfg.pop("class_name")
    _check_finite(cfg)
    where = f"{module}.{cls_name}"
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except Exception as e:  # noqa: BLE001 - whatever importing raises is a bad setting
        raise ValueError(f"dynamic backend: cannot load {where}: {_one_line(e)}") from None
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ValueError(f"dynamic backend: {where} is not a StorageBackend subclass")
    _check_keywords(where, cls, cfg)
    try:
        return cls(**cfg)
    except Exception as e:  # noqa: BLE001 - a constructor that fails is a start-up error
        given = ", ".join(cfg) or "no settings"   # names only: a value may be a secret
        raise ValueError(f"dynamic backend: {where}({given}) failed: {_one_line(e)}") from None


def _check_keywords(where: str, cls: type, cfg: dict) -> None:
    """The settings against the constructor's signature, so that a misspelt or missing
    keyword is named, not a TypeError from inside the class."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):   # none to check against: the constructor will say
        return
    try:
        sig.bind(**cfg)
    except TypeError as e:
        params = sig.parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        extra = sorted(set(cfg) - set(names))
        if extra and not any(p.kind is p.VAR_KEYWORD for p in params):
            raise ValueError(f"dynamic backend: {where} takes no setting {extra[0]!r}; it takes "
                             f"{', '.join(names) or 'none'}") from None
        raise ValueError(f"dynamic backend: {where}: {e}") from None


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
