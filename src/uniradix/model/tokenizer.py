"""A byte-level tokenizer: UTF-8 bytes are the token ids, so nothing is downloaded."""
from __future__ import annotations


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The bytes (there are no special tokens to add)."""
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")
