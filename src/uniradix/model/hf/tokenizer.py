"""A checkpoint's tokenizer and chat template, with the `tokenizers` library and jinja2
(no `transformers`): text to ids and back, and chat messages to the prompt text the
model was trained on."""
from __future__ import annotations

import json
import os
from datetime import datetime


class HFTokenizer:
    """`tokenizer` a tokenizers.Tokenizer; `settings` tokenizer_config.json;
    `chat_template` the jinja text (chat_template.jinja, or the config's own)."""

    def __init__(self, tokenizer, settings: dict | None = None, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.settings = settings or {}
        self.chat_template = chat_template or self.settings.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: the default one
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"),
                                      self.chat_template[0]["template"])
        self._template = None

    @classmethod
    def from_dir(cls, path: str) -> "HFTokenizer":
        from tokenizers import Tokenizer
        settings = {}
        cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg):
            with open(cfg) as f:
                settings = json.load(f)
        template = None
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja):
            with open(jinja) as f:
                template = f.read()
        return cls(Tokenizer.from_file(os.path.join(path, "tokenizer.json")), settings, template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token(self, name: str) -> str | None:
        """A special token's text from the settings (bos_token, eos_token, ...)."""
        t = self.settings.get(name)
        return t.get("content") if isinstance(t, dict) else t

    # The batch forms, on one item: `tokenizers` releases the GIL in them and not in
    # encode/decode, so a long text encoded on a worker thread does not stop the server's
    # event loop (measured: a 650 KB text, 2.8 s; the loop ran 3 times meanwhile, 1522
    # with encode_batch). Same ids, same text.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...])."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (chat_template.jinja or in tokenizer_config.json)")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise ValueError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.token("bos_token") or "", eos_token=self.token("eos_token") or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat prompt as ids (its special tokens are in the text already)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
