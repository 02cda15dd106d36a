"""Query-string values, checked as values before any use: a number is ASCII digits
within its bounds ("²" and "４" pass str.isdigit() and not int()), a flag is one of the
words FastAPI's and SGLang's clients send. Anything else is a 400 naming the parameter,
never an exception from deeper down (a 500)."""
from __future__ import annotations

from .protocol import want

#: digits a query integer may have (every bound here is far below 10**18)
MAX_DIGITS = 18
TRUE, FALSE = ("1", "true", "t", "yes", "y", "on"), ("0", "false", "f", "no", "n", "off")


def query_int(name: str, value: str | None, default: int, lo: int, hi: int) -> int:
    """`value` (None: absent) as an int in [lo, hi]; a 400 naming `name` otherwise."""
    if value is None:
        return default
    digits = 0 < len(value) <= MAX_DIGITS and value.isascii() and value.isdigit()
    want(digits and lo <= int(value) <= hi, name, f"an int in [{lo}, {hi}]", value)
    return int(value)


def query_bool(name: str, value: str | None, default: bool) -> bool:
    """`value` (None: absent) as a flag: true/false, 1/0, yes/no, on/off (any case)."""
    if value is None:
        return default
    word = value.lower() if value.isascii() else None
    want(word in TRUE or word in FALSE, name, "true or false", value)
    return word in TRUE
