"""Secrets out of everything that is shown: the settings a server reports, start-up
lines, log records and error messages. One rule says which names hold a secret
(`secret_name`), one function masks the secrets inside any text (`redact`):

- a URL's password, with or without a user (`redis://user:pw@host`,
  `redis://:pw@host`, one with an unescaped `/`, `?`, `#` or `@` in it: everything to
  the last `@` of the URL) and a user alone, which is often a token
  (`https://TOKEN@host`);
- the value of every key=value pair whose key names a secret, in a query string or a
  DSN (`?password=`, `&pw=`, `;AuthToken=`, `password = x`), in any case;
- the value after `key: ` where the key names a secret (`password: x`, a header
  `Authorization: Bearer x`), and the credential after `Bearer` or `Basic`;
- a quoted key naming a secret with its quoted value (`"password": "x"`,
  `password='x'`, `'password': b'x'`), as JSON text and Python reprs print them;
- a number under a quoted key naming a secret (`"pin_token": 1234`).

A name whose last word says what kind of setting it is (`key_prefix`, `password_file`,
`auth_mode`, `token_ttl`) names no secret: a path, a prefix or a mode is what an
operator needs to see (a secret inside its value is still masked). A declared setting
is judged by its declaration, not its words (`declare_plain`: uniradix.config registers
those that hold no secret, so `prefetch_timeout_per_ki_token` is shown).

`redact_value` applies the same through JSON-like values and hides whole the value of
every key that names a secret (a number too: a PIN, a password of digits).
`redact_logs` puts `redact` on every log handler, so a message or a traceback that
echoes a URL is masked wherever it is printed; uniradix.stderr_relay masks what native
code writes to standard error.

Only the standard library: every layer may import this."""
from __future__ import annotations

import logging
import re

MASK = "***"          # what replaces a secret inside a text
HIDDEN = "<hidden>"   # what replaces a whole value

#: a name holds a secret when one of its words is one of these...
_SECRET_WORDS = frozenset(("pw", "pwd", "pass", "passphrase", "passcode", "token", "key", "auth", "sig", "signature",
                           "cookie", "psk", "sas", "bearer", "jwt", "hmac", "otp"))
#: ...or ends with one of these (a compound written as one word: authkey, accesstoken)...
_SECRET_ENDINGS = ("key", "token", "pass", "pwd")
#: ...or when it contains one of these anywhere...
_SECRET_PARTS = ("passw", "secret", "credential", "apikey", "authoriz", "private", "privkey")
#: ...unless its last word is one of these: it names where or what kind, not the secret
_QUALIFIERS = frozenset(("prefix", "suffix", "path", "file", "filename", "dir", "directory", "name", "type",
                         "mode", "env", "format", "size", "len", "length", "count", "limit", "timeout", "ttl",
                         "interval"))

#: names declared as settings that hold no secret (declare_plain)
_DECLARED_PLAIN: set[str] = set()

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NOT_ALNUM = re.compile(r"[^a-z0-9]+")
#: scheme://userinfo@ : the userinfo runs to the last @ of the URL (a password may hold
#: an unescaped / ? # or @: whatever comes before the last @ is masked)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^\s'\"<>]*)@")
#: key=value, unquoted (a query string, a DSN: `password = x` too); the value ends before
#: a quote, escaped or not
_PAIR = re.compile(r"""([A-Za-z0-9_.\-]+)(\s*=\s*)((?:[^&;#\s,'"\\)\]}]|\\(?!['"]))+)""")
#: key: value, unquoted, a space after the colon (YAML, a header, a log line)
_COLON = re.compile(r"""(?<![\w'"])([A-Za-z][A-Za-z0-9_.\-]*):([ \t]+)(?:(Bearer|Basic|Token)[ \t]+)?([^\s'",;]+)""")
#: an HTTP credential wherever it stands: `Bearer x`, `Basic x`
_SCHEME_CREDENTIAL = re.compile(r"\b(Bearer|Basic)([ \t]+)([A-Za-z0-9._~+/=\-]{6,})")
#: 'key': 'value', "key"="value", key='value', 'key': b'value' (JSON text, Python reprs)
_QUOTED = re.compile(r"""(['"]?)([A-Za-z0-9_.\-]+)\1(\s*[:=]\s*(?:[bB][rR]?|[rR][bB]?)?)(['"])((?:\\.|(?!\4).)*)\4""")
#: 'key': 1234, "key": 1.5 (a number in JSON text or a repr)
_QUOTED_NUMBER = re.compile(r"""(['"])([A-Za-z0-9_.\-]+)\1(\s*:\s*)(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)(?![\w.])""")


def declare_plain(names) -> None:
    """Declare setting names that hold no secret, whatever their words say."""
    _DECLARED_PLAIN.update(str(n) for n in names)


def declared_plain() -> list[str]:
    """The names declared so far (a relay process is given them: uniradix.stderr_relay)."""
    return sorted(_DECLARED_PLAIN)


def secret_name(name) -> bool:
    """Whether a setting, a query key or a JSON key of this name holds a secret."""
    if str(name) in _DECLARED_PLAIN:
        return False
    text = _CAMEL.sub("_", str(name)).lower()
    words = [w for w in _NOT_ALNUM.split(text) if w]
    if words and words[-1] in _QUALIFIERS:
        return False
    if any(p in text for p in _SECRET_PARTS):
        return True
    return not _SECRET_WORDS.isdisjoint(words) or any(w.endswith(_SECRET_ENDINGS) and len(w) > 4 for w in words)


def _userinfo(m: re.Match) -> str:
    user, colon, _ = m.group(2).partition(":")
    return f"{m.group(1)}{user}:{MASK}@" if colon else f"{m.group(1)}{MASK}@"


def _pair(m: re.Match) -> str:
    return f"{m.group(1)}{m.group(2)}{MASK}" if secret_name(m.group(1)) else m.group(0)


def _colon(m: re.Match) -> str:
    if not secret_name(m.group(1)):
        return m.group(0)
    scheme = f"{m.group(3)} " if m.group(3) else ""
    return f"{m.group(1)}:{m.group(2)}{scheme}{MASK}"


def _quoted_number(m: re.Match) -> str:
    return f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{MASK}" if secret_name(m.group(2)) else m.group(0)


def _quoted(m: re.Match) -> str:
    if not secret_name(m.group(2)):
        return m.group(0)
    q = m.group(4)
    return f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{q}{MASK}{q}"


def redact(text) -> str:
    """`text` with every secret in it masked (see the module docstring)."""
    text = str(text)
    if "@" in text:
        text = _USERINFO.sub(_userinfo, text)
    if "=" in text:
        text = _PAIR.sub(_pair, text)
    if ":" in text:
        text = _COLON.sub(_colon, text)
    if "Bearer" in text or "Basic" in text:
        text = _SCHEME_CREDENTIAL.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    if "'" in text or '"' in text:
        text = _QUOTED.sub(_quoted, text)
        text = _QUOTED_NUMBER.sub(_quoted_number, text)
    return text


def mask_known(text, secrets) -> str:
    """`text` redacted, and every occurrence of each of `secrets` (strings a caller knows
    to be secret, 3 characters or more) masked too: a library's message may quote a
    piece of a password it could not parse, with nothing around it that says so."""
    text = redact(text)
    for secret in sorted({str(x) for x in secrets if x and len(str(x)) >= 3}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def url_secrets(url: str) -> list[str]:
    """The secret parts of a URL as written: its userinfo's password (everything between
    the first ':' after the scheme and the last '@'), each piece of it between the
    delimiters a URL parser splits at, and the values of its secret query keys."""
    out = []
    m = _USERINFO.search(url or "")
    if m:
        user, colon, password = m.group(2).partition(":")
        secret = password if colon else user
        out += [secret, *re.split(r"[:/?#@\[\]]", secret)]
    for q in _PAIR.finditer(url or ""):
        if secret_name(q.group(1)):
            out.append(q.group(3))
    return [x for x in out if x]


def redact_value(name, value):
    """A JSON-like value as it may be shown under `name`: hidden whole where the name
    holds a secret (a text, a number or a container; a flag or null stays), else its
    texts masked, through dicts and lists. `name` "": only the texts (a setting whose
    name is declared not to hold a secret)."""
    if secret_name(name) and value not in (None, "") and not isinstance(value, bool):
        return HIDDEN
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(name, v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """Masks a record's message, its arguments and its traceback before any handler
    prints them."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the handler's to report
            return True
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def redact_logs() -> None:
    """Put the masking filter on every log handler there is now (the root's, every
    logger's own, and the last-resort one), once each."""
    handlers = list(logging.getLogger().handlers)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        handlers.extend(getattr(logger, "handlers", ()))
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for h in handlers:
        if not any(isinstance(f, RedactingFilter) for f in h.filters):
            h.addFilter(RedactingFilter())


__all__ = ["HIDDEN", "MASK", "RedactingFilter", "declare_plain", "declared_plain", "redact", "redact_logs",
           "redact_value", "secret_name"]
