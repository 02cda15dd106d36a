"""A job's output text as its tokens arrive: decoded incrementally, cut at the first
stop string, and never showing what a later token could still change (an incomplete
character, the start of a stop string), so that a stream's text only ever grows.

Incremental decoding keeps two offsets into the ids: each step decodes only the tokens
from `prefix` on (a few tokens of context, so that decoders which drop a leading space
at the start of a sequence treat both decodes alike) and appends what the new tokens
add. The cost per token stays constant however long the output grows."""
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
        self.text = ""        # the decoded text of ids[:read]
        self.prefix = 0       # context start of the next decode
        self.read = 0         # ids decoded into self.text
        self.shown = ""
        self.stopped = False

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _advance(self, final: bool) -> None:
        """Decode what the new ids add, up to the last whole character: the tokens of one
        still incomplete at the end wait for the next, at most 3 of them (a character is
        at most 4 bytes, a token at least one, so bytes before the last 3 can no longer
        become a character: invalid ones show as U+FFFD); once the output is final,
        everything shows. Where the cut falls depends on the tokens alone, not on how
        many came at once (a speculative step brings several), so a stream's text is the
        same however its tokens were grouped."""
        end = len(self.ids)
        if self.read == end:
            return
        before = self.decode(self.ids[self.prefix:self.read])
        upto, now = end, self.decode(self.ids[self.prefix:end])
        if not final and now.endswith("\ufffd"):
            for held in range(1, 4):  # the fewest trailing tokens whose bytes end an incomplete character
                if end - held <= self.read:
                    return
                cut = self.decode(self.ids[self.prefix:end - held])
                if not cut.endswith("\ufffd"):
                    upto, now = end - held, cut
                    break
            else:  # none of the last 3 ends a character: what lies before them is final (invalid
                upto, now = end - 3, cut  # bytes), the 3 wait for what follows, as any would
        if len(now) > len(before):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, upto

    def update(self, new: list[int], done: bool) -> str:
        """Add tokens; returns the text that may be shown now (all of it once done)."""
        if self.stopped:
            return self.shown
        self.ids.extend(new)
        self._advance(done)
        text = self.text
        if self.trim:
            cut = min((i for i in (text.find(s, max(0, len(self.shown) - self.hold)) for s in self.stop)
                       if i >= 0), default=-1)
            if cut >= 0:
                text, done, self.stopped = text[:cut], True, True
        if not done and self.stop and self.hold:
            text = text[:max(len(self.shown), len(text) - self.hold)]
        if text.startswith(self.shown):
            self.shown = text
        return self.shown

    def delta(self, new: list[int], done: bool) -> str:
        """Only what `update` adds to the text shown before."""
        before = len(self.shown)
        return self.update(new, done)[before:]
