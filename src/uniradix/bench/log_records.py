"""The request log read back, one line at a time, each checked before any of its values
is used (`uniradix hit-rate`, `uniradix simulate`). A log comes from outside the
process: another server's, cut short by a crash, rotated, edited by hand, or hostile.

A line is checked in two steps. As text: UTF-8, at most `MAX_LINE_BYTES`, JSON nested
at most `MAX_DEPTH` deep, an object. As a record, by its kind, the three kinds
`server/request_log.py` writes: a `start` line (the settings in force: each one the
tools read is checked as the engine's config declares it), a `close_session` line,
and a request line (every field the tools read: counts are ints, times finite and
non-negative, ids within the vocabulary, a session a str or an int, a priority an int,
the counts consistent with each other and with the ids). A bad line is a `BadRecord`
naming its line number and its field, which a tool prints as one line: exit 2, or,
with `--skip-bad-lines`, said and passed over. Fields a record does not carry are
absent (null is absent too); fields the tools do not know are left alone (a newer
server's), within the bounds above."""
from __future__ import annotations

import contextlib
import json
import re
import reprlib
import sys
from dataclasses import fields

from ..config import finite_number
from ..tree.keys import check_priority, check_session_id, salt_key

#: the longest line read (a request's token ids dominate: 64 MiB holds several million)
MAX_LINE_BYTES = 64 << 20
#: the deepest JSON nesting accepted (a request line is 2 deep, a start line 2)
MAX_DEPTH = 16
#: the latest time accepted, in Unix seconds (9999-12-31 23:59:59 UTC, the last a date shows)
MAX_TIME = 253402300799.0
#: the largest count accepted (exact in a float, summed without loss)
MAX_COUNT = 2 ** 53

#: a request's prompt-token and cached-token counts, first found wins: the server's own
#: names, then the usual others (`uniradix hit-rate` reads other tools' logs too)
PROMPT = ("prompt_tokens", "prompt_tok", "input_tokens", "num_prompt_tokens")
CACHED = ("cached_tokens", "cached_tok", "cached_prompt_tokens", "prefix_hit_tokens")
#: the cached tokens by tier (they sum to the cached count)
TIERS = ("cached_device", "cached_host", "cached_storage")

START, CLOSE, REQUEST, OTHER = "start", "close_session", "request", "other"


class BadRecord(ValueError):
    """A line that cannot be used: its number (from 1), the field (None: the line as a
    whole) and what is wrong."""

    def __init__(self, line: int, field: str | None, what: str) -> None:
        field = None if field is None else _printable(field)
        self.line, self.field, self.what = line, field, what
        super().__init__(f"line {line}: {field}: {what}" if field else f"line {line}: {what}")


# ---------------------------------------------------------------------------- lines
def open_log(path: str):
    """The log as a binary file, in a `with` ('-': standard input, left open)."""
    return contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb")


def lines(f):
    """(line number, byte offset, bytes, ends with a newline) for each line of a binary
    file. A line longer than MAX_LINE_BYTES comes as None, its bytes read past, never
    held."""
    n, offset, limit = 0, 0, MAX_LINE_BYTES + 1
    readline = f.readline
    while True:
        raw = readline(limit)
        if not raw:
            return
        n += 1
        at = offset
        offset += len(raw)
        if len(raw) == limit and raw[-1] != 10:  # too long: skip to its end
            while chunk := readline(1 << 20):
                offset += len(chunk)
                if chunk[-1] == 10:
                    break
            yield n, at, None, True
            continue
        yield n, at, raw, raw[-1] == 10


def parse(n: int, raw: bytes | None, ended: bool = True) -> dict:
    """One line's record (a JSON object), or BadRecord: too long, empty, not UTF-8,
    nested too deep, not JSON (the last line cut short, when it has no newline), not an
    object."""
    if raw is None:
        raise BadRecord(n, None, f"longer than {MAX_LINE_BYTES:,} bytes")
    text = raw.strip()
    if not text:
        raise BadRecord(n, None, "an empty line")
    try:
        s = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(n, _field_at(text, e.start),
                        f"not UTF-8 (byte 0x{text[e.start]:02x} at column {e.start + 1})") from None
    if text.count(b"[") + text.count(b"{") > MAX_DEPTH:  # cheap: only then is the depth measured
        deep = _too_deep(text)
        if deep is not None:
            raise BadRecord(n, _field_at(text, deep), f"JSON nested deeper than {MAX_DEPTH}")
    try:
        rec = json.loads(s)
    except (ValueError, RecursionError) as e:
        pos = getattr(e, "pos", None)
        field = None if pos is None else _field_at(text, len(s[:pos].encode()))
        if not ended:
            raise BadRecord(n, field, "cut short: the last line has no newline and is not complete JSON") from None
        where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise BadRecord(n, field, f"not JSON ({getattr(e, 'msg', str(e))[:80]}{where})") from None
    if type(rec) is not dict:
        raise BadRecord(n, None, f"a JSON {_json_type(rec)}, not an object")
    return rec


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[\[\]{},]')


def _too_deep(text: bytes) -> int | None:
    """Where the nesting first passes MAX_DEPTH (strings skipped), or None."""
    depth = 0
    for m in _TOKENS.finditer(text):
        c = m.group()[:1]
        if c in b"[{":
            depth += 1
            if depth > MAX_DEPTH:
                return m.start()
        elif c in b"]}":
            depth -= 1
    return None


def _field_at(text: bytes, pos: int) -> str | None:
    """The top-level key whose entry holds byte `pos` of a (maybe broken) JSON object,
    or None (before the first key, or not an object)."""
    depth, key, expect = 0, None, False
    for m in _TOKENS.finditer(text):
        if m.start() > pos:
            break
        c = m.group()[:1]
        if c in b"[{":
            depth += 1
            expect = depth == 1 and c == b"{"
        elif c in b"]}":
            depth -= 1
        elif c == b",":
            expect = depth == 1
        elif depth == 1 and expect:  # a string where a key goes
            key, expect = m.group().strip(b'"').decode("utf-8", "replace"), False
    return key


def _printable(s: str) -> str:
    s = "".join(ch if ch.isprintable() else "?" for ch in s[:41])
    return s if len(s) <= 40 else s[:40] + "..."


# ---------------------------------------------------------------------------- values
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist = _repr.maxdict = 4


def _json_type(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _got(v) -> str:
    return f"got {_json_type(v)} {_repr.repr(v)}"


# A field check returns None for a good value, else what is wrong ("must be ..., got ...").
def _count(v):
    return None if type(v) is int and 0 <= v < MAX_COUNT else f"must be an int from 0 to 2**53, {_got(v)}"


def _time(v):
    if (type(v) is float or type(v) is int) and 0 <= v <= MAX_TIME:  # NaN and infinities compare false
        return None
    return f"must be a finite number of seconds from 0 to {MAX_TIME:.0f}, {_got(v)}"


def _text(v):
    return None if type(v) is str else f"must be a string, {_got(v)}"


def _rid(v):
    return None if type(v) in (str, int) else f"must be a string or an int, {_got(v)}"


def _rule(check, want: str):
    """A rule of tree/keys (it raises ValueError), the one definition the engine keeps,
    as a field check."""
    def f(v):
        try:
            check(v)
        except (ValueError, TypeError):
            return f"must be {want}, {_got(v)}"
        return None
    return f


_session = _rule(check_session_id, "a string or an int")
_salt = _rule(salt_key, "a string or an int")
_priority = _rule(check_priority, "an int in [-2**63, 2**63)")

#: a request line's fields the tools read, each checked when present (null: absent)
REQUEST_FIELDS = {"time": _time, "arrival": _time, "ttft": _time, "latency": _time, "rid": _rid,
                  "session": _session, "salt": _salt, "priority": _priority, "status": _text,
                  "finish_reason": _text, "round": _count, "prompt_logprobs_from": _count,
                  **{k: _count for k in (*PROMPT, *CACHED, *TIERS, "cached_cross_instance", "computed_tokens",
                                         "output_tokens", "spec_verify_ct", "spec_draft_tokens",
                                         "spec_accepted_tokens")}}


def first(rec: dict, names) -> tuple[str | None, int | None]:
    """The first of `names` a (checked) record carries: (name, value), or (None, None)."""
    for k in names:
        v = rec.get(k)
        if v is not None:
            return k, v
    return None, None


def _ids(n: int, name: str, v, vocab: int | None) -> None:
    if type(v) is not list:
        raise BadRecord(n, name, f"must be an array of token ids, {_got(v)}")
    if not v:
        return
    if set(map(type, v)) != {int}:
        bad = next(t for t in v if type(t) is not int)
        raise BadRecord(n, name, f"token ids must be ints, {_got(bad)}")
    lo, hi = min(v), max(v)
    if lo < 0:
        raise BadRecord(n, name, f"token ids must be >= 0, got {lo}")
    if vocab is not None and hi >= vocab:
        raise BadRecord(n, name, f"token id {_repr.repr(hi)} is past the vocabulary of {vocab}")
    if hi >= MAX_COUNT:
        raise BadRecord(n, name, f"token id {_repr.repr(hi)} is past any vocabulary")


def check_request(n: int, rec: dict, vocab: int | None = None) -> dict:
    """A request line checked (`vocab`: the model's, when known), or BadRecord."""
    fields_ = REQUEST_FIELDS
    for k, v in rec.items():
        check = fields_.get(k)
        if check is not None and v is not None:
            want = check(v)
            if want:
                raise BadRecord(n, k, want)
    ids, out = rec.get("input_ids"), rec.get("output_ids")
    if ids is not None:
        _ids(n, "input_ids", ids, vocab)
    if out is not None:
        _ids(n, "output_ids", out, vocab)
    finished = rec.get("status", "finished") == "finished"
    pk, p = first(rec, PROMPT)
    ck, c = first(rec, CACHED)
    if c is not None and p is not None and c > p:
        raise BadRecord(n, ck, f"{c} cached tokens of a {p}-token prompt ({pk})")
    if c is not None:
        for t in TIERS:
            if (rec.get(t) or 0) > c:
                raise BadRecord(n, t, f"{rec[t]} of {c} cached tokens ({ck})")
    if ids is not None:
        if finished and not ids:
            raise BadRecord(n, "input_ids", "empty: a finished request has a prompt")
        if finished and p is not None and p != len(ids):
            raise BadRecord(n, pk, f"{p}, but input_ids holds {len(ids)} tokens")
        plf = rec.get("prompt_logprobs_from")
        if plf is not None and ids and plf >= len(ids):
            raise BadRecord(n, "prompt_logprobs_from", f"{plf} is past the prompt's {len(ids)} tokens")
    if out is not None and finished:
        if not out:
            raise BadRecord(n, "output_ids", "empty: a finished request generated a token at least")
        o = rec.get("output_tokens")
        if o is not None and o != len(out):
            raise BadRecord(n, "output_tokens", f"{o}, but output_ids holds {len(out)} tokens")
    a, t = rec.get("arrival"), rec.get("time")
    if a is not None and t is not None and a > t:
        raise BadRecord(n, "arrival", f"{a} is after the request finished (time {t})")
    return rec


def check_close(n: int, rec: dict) -> dict:
    """A close_session line: when, which session (of which salt), or BadRecord."""
    for k, check in (("time", _time), ("session", _session), ("salt", _salt)):
        v = rec.get(k)
        if v is None and k != "salt":
            raise BadRecord(n, k, "missing (a close_session line names its time and session)")
        want = check(v) if v is not None else None
        if want:
            raise BadRecord(n, k, want)
    return rec


def _setting_fields() -> dict:
    """Every setting the engine's config declares, by name (its choices and check)."""
    from ..config import GROUPS, ComputeSettings, ModelSettings
    out = {}
    for cls in (*GROUPS.values(), ModelSettings, ComputeSettings):
        for f in fields(cls):
            if "help" in f.metadata:
                out.setdefault(f.name, f)
    return out


_SETTINGS = None
#: the start line's settings besides the config's (what `uniradix serve` adds)
_EXTRA_SETTINGS = {"vocab_size": lambda v: None if type(v) is int and v >= 1 else f"must be an int >= 1, {_got(v)}"}


def check_start(n: int, rec: dict) -> dict:
    """A start line: its time and its settings, each one the config declares checked as
    the config checks it (null: the default), or BadRecord naming `settings.NAME`."""
    global _SETTINGS
    if _SETTINGS is None:
        _SETTINGS = _setting_fields()
    t = rec.get("time")
    if t is not None and _time(t):
        raise BadRecord(n, "time", _time(t))
    s = rec.get("settings")
    if type(s) is not dict:
        raise BadRecord(n, "settings", f"must be an object (the settings by name), {_got(s)}")
    for k, v in s.items():
        if v is None:
            continue
        extra = _EXTRA_SETTINGS.get(k)
        if extra is not None:
            want = extra(v)
        elif k in _SETTINGS:
            want = _declared(_SETTINGS[k], v)
        else:
            continue  # not one the tools read (a newer server's)
        if want:
            raise BadRecord(n, f"settings.{k}", want)
    return rec


def _declared(f, v) -> str | None:
    md = f.metadata
    choices, check = md.get("choices"), md.get("check")
    try:
        if choices is not None and (type(v) not in (str, int, float, bool) or v not in choices):
            return f"must be one of {', '.join(map(str, choices))}, {_got(v)}"
        want = check(v) if check is not None else None
    except (TypeError, ValueError):
        want = "a valid value"
    if want is None and check is None and choices is None:  # declared by its default's type alone
        d = f.default
        if isinstance(d, bool) and type(v) is not bool:
            want = "true or false"
        elif type(d) is int and type(v) is not int:
            want = "an int"
        elif type(d) is float and not finite_number(v):
            want = "a finite number"
        elif type(d) is str and type(v) is not str:
            want = "a string"
    return f"must be {want}, {_got(v)}" if want else None


def check(n: int, rec: dict, vocab: int | None = None) -> str:
    """The kind of a parsed line (START, CLOSE, REQUEST or OTHER: an event the tools do
    not read), its fields checked, or BadRecord."""
    ev = rec.get("event")
    if ev is None:
        check_request(n, rec, vocab)
        return REQUEST
    if type(ev) is not str:
        raise BadRecord(n, "event", f"must be a string, {_got(ev)}")
    if ev == "start":
        check_start(n, rec)
        return START
    if ev == "close_session":
        check_close(n, rec)
        return CLOSE
    return OTHER


# ---------------------------------------------------------------------------- reading
class BadLines:
    """What a tool does with a bad line: raise it (the default: the tool says it in one
    line and exits 2), or with `skip`, say it on `err` (the first `say` of them, then
    how many more) and go on."""

    def __init__(self, tool: str, path: str, skip: bool, err=None, say: int = 10) -> None:
        self.tool, self.path, self.skip, self.err, self.say = tool, path, skip, err, say
        self.count = 0

    def __call__(self, e: BadRecord) -> None:
        if not self.skip:
            raise e
        self.count += 1
        if self.count <= self.say:
            print(self.message(e) + " (skipped)", file=self.err or sys.stderr)

    def message(self, e: BadRecord) -> str:
        return f"uniradix {self.tool}: {self.path} {e}"

    def summary(self) -> str | None:
        if not self.count:
            return None
        more = f" ({self.count - self.say} not shown)" if self.count > self.say else ""
        return f"{self.count} bad line(s) skipped{more}"


def records(f, vocab=None, bad=None):
    """Each good line of a binary file: (line number, offset, kind, record). `vocab`: an
    int, or a function of a start line's settings giving one (None: ids unbounded);
    each request is checked against the vocabulary of the start line before it.
    `bad(BadRecord)`: told of each bad line (it raises to stop); None raises."""
    fixed = vocab if not callable(vocab) else None
    current = fixed
    for n, offset, raw, ended in lines(f):
        try:
            rec = parse(n, raw, ended)
            kind = check(n, rec, current)
        except BadRecord as e:
            if bad is None:
                raise
            bad(e)
            continue
        if kind == START and callable(vocab):
            current = vocab(rec["settings"])
        yield n, offset, kind, rec


def first_start(f) -> tuple[int, dict] | None:
    """The first good start line of a binary file: (line number, record); None when it
    has none. Reads only as far as it (lines without the word pass unparsed)."""
    for n, _, raw, ended in lines(f):
        if raw is None or b'"start"' not in raw:
            continue
        try:
            rec = parse(n, raw, ended)
            if rec.get("event") == "start":
                return n, check_start(n, rec)
        except BadRecord:
            continue  # said in its place when the log is read
    return None
