"""The server's two small mechanisms on their own: output text that only grows (stop
strings cut, partial characters held back) and sessions' idle deadlines."""
from uniradix.model.tokenizer import ByteTokenizer
from uniradix.server.sessions import Sessions
from uniradix.server.textout import TextOut


def feed(out: TextOut, data: bytes, done_at_end: bool = True) -> list[str]:
    shown = []
    for i, b in enumerate(data):
        shown.append(out.update([b], done_at_end and i == len(data) - 1))
    return shown


def test_text_only_grows_and_stops_are_cut():
    out = TextOut(ByteTokenizer(), stop=("END",))
    shown = feed(out, b"hello ENDING")
    assert all(a == b[:len(a)] for a, b in zip(shown, shown[1:]))
    assert shown[-1] == "hello "
    assert "E" not in shown[5]  # "E" might start the stop string: held back until it cannot


def test_no_stop_trim_keeps_the_stop_string():
    out = TextOut(ByteTokenizer(), stop=("END",), no_stop_trim=True)
    assert feed(out, b"hello END")[-1] == "hello END"


def test_a_partial_character_is_held_back():
    out = TextOut(ByteTokenizer())
    snow = "é".encode()
    assert out.update([snow[0]], False) == ""
    assert out.update([snow[1]], True) == "é"
    d = TextOut(ByteTokenizer())
    assert "".join(d.delta([b], i == 4) for i, b in enumerate(b"ab\xc3\xa9c")) == "abéc"


def test_sessions_expire_only_when_idle():
    s = Sessions(default_timeout=None)
    a = s.open(timeout=10)
    b = s.open()
    s.begin("implicit")  # a session first seen on a request opens itself
    assert s.is_open("implicit") and len(s) == 3
    s.begin(a)
    assert s.expired(now=1e12) == []  # a request in flight keeps it open
    s.end(a)
    assert s.expired(now=1e12) == [(a, None)]  # b and implicit: no timeout
    assert s.close(a) and not s.close(a)
    assert s.next_deadline() is None and s.is_open(b)


def test_the_text_is_the_same_however_the_tokens_come_grouped():
    """A speculative step brings several tokens at once: a character split across a
    group's end waits for its last byte, invalid bytes show as U+FFFD, and the text a
    stream ends with (and every text it shows on the way) is the same for groups of 1,
    2, 3, 5 or all of them."""
    data = "ab é€x 😀y".encode() + b"\xc5a\x80\x80\xe2\x82" + "ü 中文z".encode() + b"\xff\xf0\x9f"
    results = {}
    for size in (1, 2, 3, 5, len(data)):
        out = TextOut(ByteTokenizer())
        shown = []
        for i in range(0, len(data), size):
            shown.append(out.update(list(data[i:i + size]), i + size >= len(data)))
        assert all(a == b[:len(a)] for a, b in zip(shown, shown[1:])), size
        results[size] = shown[-1]
    assert len(set(results.values())) == 1, results
    assert results[1] == ByteTokenizer().decode(list(data))
