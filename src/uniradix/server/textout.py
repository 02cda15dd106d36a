"""A job's output text as its tokens arrive: decoded, cut at the first stop string, and
never showing what a later token could still change (an incomplete character, the
start of a stop string), so that a stream's text only ever grows."""
from __future__ import annotations


class TextOut:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 no_stop_trim: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip = skip_special_tokens
        self.trim = bool(stop) and not no_stop_trim
        self.hold = max(map(len, stop), default=1) - 1
        self.ids: list[int] = []
        self.shown = ""

    def decode(self, ids) -> str:
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip)
        except TypeError:  # the embedded byte tokenizer has no special tokens
            return self.tokenizer.decode(ids)

    def update(self, new: list[int], done: bool) -> str:
        """Add tokens; returns the text that may be shown now (all of it once done)."""
        self.ids.extend(new)
        text = self.decode(self.ids)
        if self.trim:
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, done = text[:cut], True
        if not done:
            text = text.rstrip("\ufffd")
            if self.stop and self.hold:
                text = text[:max(len(self.shown), len(text) - self.hold)]
        if text.startswith(self.shown):
            self.shown = text
        return self.shown

    def delta(self, new: list[int], done: bool) -> str:
        """Only what `update` adds to the text shown before."""
        before = len(self.shown)
        return self.update(new, done)[before:]
