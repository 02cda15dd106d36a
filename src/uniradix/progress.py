"""Progress of the long start-up phases (a checkpoint's tensors read, dequantized,
quantized and packed): a bar on a terminal, nothing where stderr is a file or a pipe
(logs, tests, a server under a supervisor), so that loading a model is never silent to a
person and never noise to a machine."""
from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """`items`, with a bar named `desc` on a terminal (tqdm; it goes when done)."""
    if not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm
    yield from tqdm(items, desc=desc, total=total, unit="tensor", file=sys.stderr, leave=False,
                    dynamic_ncols=True)
