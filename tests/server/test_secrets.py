"""No secret is ever shown: a password in a URL (with a user, without one, in the query
string in any case), a token as a URL's user, a DSN's password, and the value of every
extra-config key that names a secret stay out of /get_server_info, the start-up log,
the log lines and tracebacks of a failing backend, and the errors `uniradix serve` and
`uniradix run` print. One rule masks them all (uniradix.redact)."""
import json
import logging
import os
from pathlib import Path

import pytest
from server_proc import ServerProc

from uniradix.config import StorageConfig, redact_extra_config

MASK, HIDDEN = "***", "<hidden>"  # uniradix.redact's: inside a text, a whole value
HERE = Path(__file__).resolve().parent
SECRETS = [f"S3CRET{i}x" for i in range(12)]
EXTRA = {
    "module_path": "leaky_backend", "class_name": "LeakyBackend",
    "url": f"redis://user:{SECRETS[0]}@127.0.0.1:9/0?password={SECRETS[1]}&db=0&Auth_Token={SECRETS[2]}",
    "mirror": f"redis://:{SECRETS[3]}@127.0.0.1:9/1?PW={SECRETS[4]}",
    "backup": f"https://{SECRETS[5]}@127.0.0.1/bucket",
    "dsn": f"host=127.0.0.1 user=u password={SECRETS[6]} dbname=x",
    "api_key": SECRETS[7],
    "nested": {"Password": SECRETS[8], "hosts": [f"rediss://:{SECRETS[9]}@127.0.0.1:9/0"]},
    "accessToken": SECRETS[10],
    "auth_secret": SECRETS[11],  # the tier's own (the objects' MAC key)
}


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


# ---------------------------------------------------------------------------- the rule
URLS = [
    ("redis://user:pw@h:6379/0", "redis://user:***@h:6379/0"),
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://:p@ss@h/0", "redis://:***@h/0"),                     # an unescaped @ in the password
    ("redis://h:6379/0?password=pw", "redis://h:6379/0?password=***"),
    ("redis://h/0?db=1&PassWord=pw&x=2", "redis://h/0?db=1&PassWord=***&x=2"),
    ("unix:///tmp/r.sock?db=0&pw=pw", "unix:///tmp/r.sock?db=0&pw=***"),
    ("https://tok@h/x?sig=pw", "https://***@h/x?sig=***"),         # a token as the user; a signed URL
    ("host=h password=pw dbname=x", "host=h password=*** dbname=x"),
    ("x;AccountKey=pw;y", "x;AccountKey=***;y"),
    ("{'password': 'pw', 'url': 'u'}", "{'password': '***', 'url': 'u'}"),
    ('{"api_key": "pw", "prompt_tokens": 5}', '{"api_key": "***", "prompt_tokens": 5}'),
    (r'{"x": "{\"u\": \"h?token=pw\", \"k\": 1}"}', r'{"x": "{\"u\": \"h?token=***\", \"k\": 1}"}'),  # JSON in JSON
    ("{'password': b'pw', 'auth': rb'pw'}", "{'password': b'***', 'auth': rb'***'}"),  # bytes in a repr
    ("with {'token': 123456, 'n': 5}", "with {'token': ***, 'n': 5}"),  # digits in a repr
    ("redis://default:Hun/ter2+==@h:6379/0", "redis://default:***@h:6379/0"),  # a / in the password (base64)
    ("redis://u:a?b#c@h/0", "redis://u:***@h/0"),                  # ? and # in it
    ("host=h password = pw dbname=x", "host=h password = *** dbname=x"),  # a DSN with spaces around =
    ("Authorization: Bearer pwpwpwpw", "Authorization: Bearer ***"),  # a header
    ("password: pw and token:\tpw", "password: *** and token:\t***"),  # YAML-ish text
    ("sent Bearer pwpwpwpw to h", "sent Bearer *** to h"),
    ("error: max_tokens: 5, url: redis://h:1", "error: max_tokens: 5, url: redis://h:1"),  # names no secret
    ("redis://h:6379/0", "redis://h:6379/0"),                      # nothing to hide
    ("Error 111 connecting to 127.0.0.1:6399. Connection refused.", None),
]


@pytest.mark.parametrize("text,shown", URLS)
def test_every_form_is_masked(text, shown):
    from uniradix.redact import redact
    assert redact(text) == (text if shown is None else shown)


def test_which_names_hold_a_secret():
    from uniradix.redact import redact_value, secret_name
    for name in ("password", "PASSWD", "pw", "auth_secret", "api_key", "apiKey", "accessToken", "Authorization",
                 "private_key", "credentials", "sig", "auth", "authkey", "accesskey", "authtoken", "accesstoken",
                 "masterkey", "privkey", "refreshtoken", "storagekey", "passcode", "bearer", "jwt", "hmac"):
        assert secret_name(name), name
    for name in ("prompt_tokens", "max_total_tokens", "prefix", "path", "url", "hosts", "author", "keys",
                 "model_fingerprint", "master"):
        assert not secret_name(name), name
    assert redact_value("token", "abc") == HIDDEN and redact_value("auth", {"user": "u"}) == HIDDEN


def test_what_says_where_or_what_kind_is_shown_and_a_secret_of_digits_is_not():
    """Before: a key prefix, a secret's file and an auth mode were hidden as secrets (an
    operator could not see them), and a password of digits was shown."""
    from uniradix.redact import redact_value, secret_name
    for name in ("key_prefix", "keyPrefix", "password_file", "api_key_path", "secret_name", "auth_mode",
                 "token_ttl", "ssl_key_dir"):
        assert not secret_name(name), name
    assert secret_name("private_key") and secret_name("redis_password") and secret_name("auth_token")
    extra = {"password": 12345678, "nested": {"pin_token": 4321, "use_auth": True, "key_prefix": "k:"},
             "key_prefix": "tenant-a:", "password_file": "/run/secrets/redis",
             "prefetch_timeout_per_ki_token": 0.5, "auth_secret": "zz"}
    shown = json.loads(redact_extra_config(json.dumps(extra)))
    assert shown["password"] == shown["nested"]["pin_token"] == shown["auth_secret"] == HIDDEN
    assert shown["nested"]["use_auth"] is True and shown["nested"]["key_prefix"] == "k:"  # a flag, a prefix
    assert shown["key_prefix"] == "tenant-a:" and shown["password_file"] == "/run/secrets/redis"
    assert shown["prefetch_timeout_per_ki_token"] == 0.5  # the tier's own setting, declared not secret
    settings = StorageConfig(hicache_storage_backend="file", prefetch_timeout_per_ki_token=0.5).as_dict()
    assert settings["prefetch_timeout_per_ki_token"] == 0.5
    with pytest.raises(ValueError, match="prefetch_timeout_per_ki_token must be .*got 'soon'"):  # not <hidden>
        StorageConfig(prefetch_timeout_per_ki_token="soon")
    assert redact_value("", {"pw": 1234})["pw"] == HIDDEN


def test_the_extra_config_and_settings_show_no_secret():
    shown = redact_extra_config(json.dumps(EXTRA))
    assert not leaks(shown), shown
    parsed = json.loads(shown)
    assert parsed["api_key"] == parsed["auth_secret"] == parsed["accessToken"] == HIDDEN
    assert parsed["url"].startswith(f"redis://user:{MASK}@127.0.0.1:9/0?password={MASK}&db=0")
    settings = StorageConfig(hicache_storage_backend="dynamic",
                             hicache_storage_backend_extra_config=json.dumps(EXTRA), auth_secret=SECRETS[11])
    assert not leaks(json.dumps(settings.as_dict()))


def test_a_secret_from_the_environment_is_reported_in_force_and_hidden(monkeypatch):
    """Before: with the MAC key in $UNIRADIX_L3_SECRET, /get_server_info said
    auth_secret null, as if the objects were unkeyed."""
    monkeypatch.delenv("UNIRADIX_L3_SECRET", raising=False)
    cfg = StorageConfig(hicache_storage_backend="file")
    assert cfg.as_dict()["auth_secret"] is None
    monkeypatch.setenv("UNIRADIX_L3_SECRET", SECRETS[0])
    shown = cfg.as_dict()["auth_secret"]
    assert shown == f"{HIDDEN} (from $UNIRADIX_L3_SECRET)" and not leaks(json.dumps(cfg.as_dict()))
    assert StorageConfig().as_dict()["auth_secret"] is None  # no L3: no secret in force


def test_log_records_and_their_tracebacks_are_masked():
    from uniradix.redact import RedactingFilter
    rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "reaching %s failed", (EXTRA["url"],), None)
    try:
        raise ConnectionError(f"cannot reach {EXTRA['mirror']}")
    except ConnectionError:
        import sys
        rec.exc_info = sys.exc_info()
    assert RedactingFilter().filter(rec)
    text = logging.Formatter().format(rec)
    assert "Traceback" in text and "cannot reach redis://:***@" in text and not leaks(text), text


def test_the_redis_backend_masks_every_form_in_its_errors(caplog):
    pytest.importorskip("redis")
    import socket

    from uniradix.hicache.backends.redis import RedisBackend
    from uniradix.hicache.storage import StorageUnavailable
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://:{SECRETS[0]}@127.0.0.1:{port}/0?password={SECRETS[1]}"
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        b = RedisBackend(url, socket_timeout=1.0)  # warns that the server is unreachable
    with b:
        with pytest.raises(StorageUnavailable) as e:
            b.batch_get(["0" * 64])
        shown = [str(e.value), repr(b), str(b.stats()), *(r.getMessage() for r in caplog.records)]
    assert f"redis://:***@127.0.0.1:{port}/0?password=***" in str(e.value)
    assert not leaks(" ".join(shown)), shown


@pytest.mark.parametrize("password", [f"{SECRETS[0]}/{SECRETS[1]}", f"{SECRETS[0]}#{SECRETS[1]}",
                                      f"{SECRETS[0]}?{SECRETS[1]}=="])
def test_a_redis_url_it_cannot_parse_shows_no_piece_of_its_password(password, capsys):
    """Before: a password with an unescaped / (base64 has them) was not masked, and
    redis-py's own message quoted a piece of it back ("Port could not be cast to integer
    value as 'S3CRET...'"), at start-up of serve and run."""
    pytest.importorskip("redis")
    from uniradix.cli import main
    from uniradix.hicache.backends.redis import RedisBackend
    url = f"redis://default:{password}@127.0.0.1:9/0"
    try:
        RedisBackend(url, socket_timeout=0.2).close()
    except ValueError as e:
        assert not leaks(str(e)) and "redis://default:***@" in str(e), str(e)
    extra = json.dumps({"url": url})
    main(["run", "--hicache-storage-backend", "redis", "--hicache-storage-backend-extra-config", extra,
          "--no-progress", "--clients", "1", "--rounds", "1"])
    out = capsys.readouterr()
    assert not leaks(out.out + out.err), out


def test_a_redis_url_with_an_option_redis_does_not_know_is_a_clear_error(capsys):
    """Before: redis-py took ?PASSWORD= (its names are lower case) as a connection
    setting and raised a TypeError at the first connect: a traceback at start-up."""
    pytest.importorskip("redis")
    from uniradix.cli import main
    from uniradix.hicache.backends.redis import RedisBackend
    url = f"redis://:{SECRETS[0]}@127.0.0.1:9/0?db=0&PASSWORD={SECRETS[1]}"
    with pytest.raises(ValueError, match="unknown query option 'PASSWORD'") as e:
        RedisBackend(url)
    assert not leaks(str(e.value)) and "PASSWORD=***" in str(e.value)
    extra = json.dumps({"url": url})
    assert main(["run", "--hicache-storage-backend", "redis", "--hicache-storage-backend-extra-config", extra,
                 "--no-progress"]) == 2
    out = capsys.readouterr()
    assert "unknown query option 'PASSWORD'" in out.err and not leaks(out.out + out.err), out


def test_what_native_code_writes_to_stderr_is_masked(capfd):
    """Before: a native library (Mooncake's client logs its metadata server's URL)
    wrote secrets straight to descriptor 2, past every log filter."""
    from uniradix.stderr_relay import masked_stderr
    with masked_stderr():
        os.write(2, f"E1201 PUT {EXTRA['mirror']} failed\n".encode())
        os.write(2, b"\rprogress 50%")  # a partial line still comes out
    err = capfd.readouterr().err
    assert not leaks(err), err
    assert "PUT redis://:***@127.0.0.1:9/1?PW=*** failed" in err and "progress 50%" in err


# ---------------------------------------------------------------------------- everywhere it is printed
def env() -> dict:
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}


def test_server_info_logs_and_backend_errors_show_no_secret():
    s = ServerProc("--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                   json.dumps({**EXTRA, "native_echo": True, "allow_unavailable_at_start": True}), "--page-size", "4",
                   env=env())
    try:
        code, info, _ = s.get("/get_server_info")
        assert code == 200 and not leaks(json.dumps(info)), info
        assert json.loads(info["hicache_storage_backend_extra_config"])["dsn"].endswith(f"password={MASK} dbname=x")
        body = {"input_ids": [3 + i % 200 for i in range(300)], "sampling_params": {"max_new_tokens": 2}}
        for _ in range(2):  # the backend fails every call: L3 errors are logged, the requests are served
            assert s.post("/generate", body)[0] == 200
        s.wait_idle()
    finally:
        assert s.stop() == 0
    log = "".join(s.lines)
    assert not leaks(log), [line for line in s.lines if leaks(line)]
    assert f"leaky backend: connecting to redis://user:{MASK}@127.0.0.1:9/0?password={MASK}" in log  # start-up
    assert "settings: {" in log and '\\"api_key\\": \\"<hidden>\\"' in log  # the start-up settings line
    assert '"prefetch_timeout_per_ki_token": 0.25' in log  # a declared setting, shown whatever its words
    assert "is unreachable" in log  # the backend's failing calls were logged (masked)
    assert f"PUT redis://user:{MASK}@127.0.0.1:9/0?password={MASK}" in log  # and its native output


@pytest.mark.parametrize("command", ["serve", "run"])
def test_start_up_errors_show_no_secret(command, capsys, monkeypatch):
    from uniradix.cli import main
    monkeypatch.syspath_prepend(str(HERE))
    extra = json.dumps({**EXTRA, "fail_start": True})
    args = [command, "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", extra]
    assert main(args + (["--port", "0"] if command == "serve" else ["--no-progress"])) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "cannot reach redis://user:***@127.0.0.1:9/0?password=***" in text and not leaks(text), text
