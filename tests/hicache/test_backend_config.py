"""Configuration mistakes in `--hicache-storage-backend-extra-config`, as the CLI passes
it (JSON text) to make_backend: each one is a one-line ValueError that names the backend
and the setting and says what is expected, never a traceback from deeper down. Also the
tier's own keys (TIER_KEYS), which never reach a backend. No server is needed: settings
are checked before any connection."""
from __future__ import annotations

import json
import os
import sys
import uuid

import pytest
from backend_contract import DictBackend, read_only_later

from uniradix.hicache.backends import TIER_KEYS, make_backend
from uniradix.hicache.backends.file import FileBackend

MOD = __name__


class TaggedBackend(DictBackend):
    """A user backend for the dynamic loader: `tag` is required, and must be >= 0."""

    name = "tagged"

    def __init__(self, tag, colour_blind: bool = False):
        if isinstance(tag, int) and tag < 0:
            raise ValueError(f"tag must be >= 0,\ngot {tag}")
        super().__init__(tag)


def config_error(name: str, extra) -> str:
    """The message of the ValueError make_backend raises: one line naming the backend."""
    with pytest.raises(ValueError) as e:
        make_backend(name, extra)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert f"{name} backend" in msg, msg
    return msg


@pytest.fixture(autouse=True)
def no_mooncake_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("MOONCAKE_"):
            monkeypatch.delenv(k)


M = '"master": "127.0.0.1:50051", '   # a valid master, for the other mooncake settings

# (backend, the extra config as JSON text, the setting the message names, what it says)
CASES = [
    ("file", '{"path": 5}', "path", "must be a non-empty string"),
    ("file", '{"path": null}', "path", "must be a non-empty string"),
    ("file", '{"path": ""}', "path", "must be a non-empty string"),
    ("file", '{"path": ["/tmp/x"]}', "path", "must be a non-empty string"),
    ("file", '{"fsync": "yes"}', "fsync", "must be true or false"),
    ("file", '{"fsync": 1}', "fsync", "must be true or false"),
    ("file", '{"fsync": null}', "fsync", "must be true or false"),
    ("file", '{"fsync": NaN}', "fsync", "must be true or false"),
    ("file", '{"path": NaN}', "path", "must be a non-empty string"),
    ("file", '{"colour": "red"}', "colour", "it takes path, fsync"),
    ("redis", '{"socket_timeout": "2"}', "socket_timeout", "must be a positive, finite number"),
    ("redis", '{"socket_timeout": Infinity}', "socket_timeout", "positive, finite number"),
    ("redis", '{"socket_timeout": -Infinity}', "socket_timeout", "positive, finite number"),
    ("redis", '{"socket_timeout": NaN}', "socket_timeout", "positive, finite number"),
    ("redis", '{"socket_timeout": null}', "socket_timeout", "must be a positive, finite number"),
    ("redis", '{"socket_timeout": true}', "socket_timeout", "must be a positive, finite number"),
    ("redis", '{"socket_timeout": 0}', "socket_timeout", "must be a positive, finite number"),
    ("redis", '{"url": 6379}', "url", "must be a non-empty string"),
    ("redis", '{"url": null}', "url", "must be a non-empty string"),
    ("redis", '{"prefix": 5}', "prefix", "must be a string"),
    ("redis", '{"prefix": null}', "prefix", "must be a string"),
    ("redis", '{"host": "127.0.0.1"}', "host", "it takes url, prefix, socket_timeout"),
    ("mooncake", '{"master": 50051}', "master", "must be a string host:port"),
    ("mooncake", '{"master": null}', "master", "must be a string host:port"),
    ("mooncake", '{"master": ["h:1"]}', "master", "must be a string host:port"),
    ("mooncake", '{"master": "127.0.0.1"}', "master", "host:port"),
    ("mooncake", "{}", "master", "MOONCAKE_MASTER"),
    ("mooncake", '{%s"protocol": 5}' % M, "protocol", "must be a string"),
    ("mooncake", '{%s"MOONCAKE_PROTOCOL": null}' % M, "protocol (given as MOONCAKE_PROTOCOL)",
     "must be a string"),
    ("mooncake", '{%s"device": null}' % M, "device", "must be a string"),
    ("mooncake", '{%s"device_name": 0}' % M, "device (given as device_name)", "must be a string"),
    ("mooncake", '{%s"local_hostname": []}' % M, "local_hostname", "must be a string"),
    ("mooncake", '{%s"te_meta_data_server": 1}' % M, "te_meta_data_server", "must be a string"),
    ("mooncake", '{%s"global_segment_size": 1.5}' % M, "global_segment_size", "whole number of bytes"),
    ("mooncake", '{%s"global_segment_size": null}' % M, "global_segment_size", "whole number of bytes"),
    ("mooncake", '{%s"global_segment_size": NaN}' % M, "global_segment_size", "whole number of bytes"),
    ("mooncake", '{%s"local_buffer_size": Infinity}' % M, "local_buffer_size", "whole number of bytes"),
    ("mooncake", '{%s"global_segment_size": "lots"}' % M, "global_segment_size", "size like '64MB'"),
    ("mooncake", '{%s"global_segment_size": 1e30}' % M, "global_segment_size", "whole number of bytes"),
    ("mooncake", '{%s"global_segment_size": %d}' % (M, 1 << 70), "global_segment_size",
     "less than 2**63"),
    ("mooncake", '{%s"local_buffer_size": true}' % M, "local_buffer_size", "must be a size"),
    ("mooncake", '{%s"local_buffer_size": "512"}' % M, "local_buffer_size", "at least 1 KiB"),
    ("mooncake", '{%s"connect_timeout": "2"}' % M, "connect_timeout", "positive, finite number"),
    ("mooncake", '{%s"connect_timeout": Infinity}' % M, "connect_timeout", "positive, finite number"),
    ("mooncake", '{%s"connect_timeout": NaN}' % M, "connect_timeout", "positive, finite number"),
    ("mooncake", '{%s"protocol": NaN}' % M, "protocol", "must be a string"),
    ("mooncake", '{%s"connect_timeout": null}' % M, "connect_timeout", "positive, finite number"),
    ("mooncake", '{%s"prefix": 5}' % M, "prefix", "must be up to 128 of"),
    ("mooncake", '{%s"prefix": "a\\n"}' % M, "prefix", "must be up to 128 of"),
    ("mooncake", '{%s"mastr": "h:2"}' % M, "mastr", "unknown setting"),
    ("dynamic", '{"class_name": "X"}', "module_path", "needs"),
    ("dynamic", '{"module_path": 5, "class_name": "X"}', "module_path", "non-empty string"),
    ("dynamic", '{"module_path": "json", "class_name": null}', "class_name", "non-empty string"),
    ("dynamic", '{"module_path": "", "class_name": "X"}', "module_path", "non-empty string"),
    ("dynamic", '{"module_path": "no_such_module_xyz", "class_name": "X"}', "no_such_module_xyz.X",
     "cannot load"),
    ("dynamic", '{"module_path": "%s", "class_name": "Nope"}' % MOD, f"{MOD}.Nope", "cannot load"),
    ("dynamic", '{"module_path": "json", "class_name": "JSONDecoder"}', "json.JSONDecoder",
     "not a StorageBackend subclass"),
]


@pytest.mark.parametrize("name, extra, setting, says", CASES,
                         ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_a_config_mistake_is_one_clear_line(name, extra, setting, says):
    msg = config_error(name, extra)
    assert setting in msg and says in msg, msg


def test_a_bad_value_from_the_environment_says_so(monkeypatch):
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "lots")
    msg = config_error("mooncake", '{"master": "127.0.0.1:50051"}')
    assert "global_segment_size (from the environment, MOONCAKE_GLOBAL_SEGMENT_SIZE)" in msg


# --------------------------------------------------------------------------- file paths
def test_a_file_path_under_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("not a directory")
    for path in (f / "l3", f):
        msg = config_error("file", json.dumps({"path": str(path)}))
        assert f"the 'path' setting {str(path)!r} must be a writable directory" in msg, msg
    assert "Not a directory" in config_error("file", {"path": str(f / "l3")})
    assert "it is a file" in config_error("file", {"path": str(f)})


def test_a_read_only_file_path(tmp_path):
    path = str(tmp_path / "ro")
    with read_only_later(path) as freeze:
        freeze()
        msg = config_error("file", json.dumps({"path": path}))
        assert f"the 'path' setting {path!r} must be a writable directory; cannot write there" in msg
        with pytest.raises(ValueError, match="cannot create it"):
            FileBackend(os.path.join(path, "sub"))     # nor below it
        assert os.listdir(path) == []


# --------------------------------------------------------------------------- dynamic
def dynamic(**cfg) -> dict:
    return {"module_path": MOD, "class_name": "TaggedBackend", **cfg}


def test_dynamic_keyword_the_class_does_not_take():
    msg = config_error("dynamic", dynamic(tag=1, colour="red"))
    assert f"{MOD}.TaggedBackend takes no setting 'colour'; it takes tag, colour_blind" in msg


def test_dynamic_required_keyword_missing():
    msg = config_error("dynamic", dynamic(colour_blind=True))
    assert f"{MOD}.TaggedBackend" in msg and "'tag'" in msg and "missing" in msg


def test_dynamic_constructor_that_fails():
    msg = config_error("dynamic", dynamic(tag=-1, colour_blind=False))
    assert f"{MOD}.TaggedBackend(tag, colour_blind) failed: ValueError: tag must be >= 0, got -1" in msg


def test_dynamic_non_finite_number_anywhere():
    msg = config_error("dynamic", json.dumps(dynamic(tag={"a": [1, float("nan")]})))
    assert "setting 'tag' must be a finite number, got nan" in msg


def test_dynamic_module_that_fails_to_import(tmp_path, monkeypatch):
    name = f"uniradix_test_boom_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        msg = config_error("dynamic", {"module_path": name, "class_name": "X"})
    finally:
        sys.modules.pop(name, None)
    assert f"cannot load {name}.X: RuntimeError: boom at import" in msg


def test_dynamic_backend_built():
    b = make_backend("dynamic", dynamic(tag=3))
    assert isinstance(b, TaggedBackend) and b.tag == 3
    assert b.batch_contains([]) == []   # the base class's default batch_contains


# --------------------------------------------------------------------------- tier keys
def test_tier_keys_never_reach_the_backend(tmp_path):
    assert set(TIER_KEYS) == {"prefetch_threshold", "prefetch_timeout_base",
                              "prefetch_timeout_per_ki_token", "prefetch_timeout_max", "io_timeout",
                              "model_fingerprint", "auth_secret", "announce_interval", "allow_unavailable_at_start"}
    tier = {"prefetch_threshold": 64, "prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.5,
            "prefetch_timeout_max": 3, "io_timeout": 5, "model_fingerprint": "abc123", "auth_secret": "s3cret",
            "allow_unavailable_at_start": True}
    b = make_backend("file", json.dumps({"path": str(tmp_path / "l3"), **tier}))
    assert isinstance(b, FileBackend)
    b = make_backend("dynamic", dynamic(tag=1, **tier))   # not passed to the constructor
    assert b.tag == 1
    # a misspelt tier key is no tier key: the backend refuses it
    assert "prefetch_thresold" in config_error("file", {"path": str(tmp_path), "prefetch_thresold": 1})
