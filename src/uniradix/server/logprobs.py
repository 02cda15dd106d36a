"""Output log probabilities in each API's shape, from a request's `output_logprobs`
(the engine's: per output token, its logprob under the raw distribution and the k
likeliest tokens with theirs).

- SGLang's `/generate` (`return_logprob`, `top_logprobs_num`, `return_text_in_logprobs`):
  `meta_info.output_token_logprobs` [[logprob, id, text or null], ...] and
  `output_top_logprobs` [[[logprob, id, text or null], ...], ...].
- OpenAI completions (`logprobs`: k): `tokens`, `token_logprobs`, `top_logprobs`
  ([{text: logprob}, ...]) and `text_offset`.
- OpenAI chat (`logprobs: true`, `top_logprobs`: k): `content` [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}].

Prompt logprobs (SGLang's `logprob_start_len` >= 0: `input_token_logprobs` and
`input_top_logprobs`; OpenAI completions' `echo` with `logprobs`) come from the
request's `prompt_logprobs`: the engine recomputes the asked range rather than take it
from the cache (Request.prompt_logprobs_from), so they are what the cache-off engine
gives."""
from __future__ import annotations


def _text(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok], skip_special_tokens=False)


def sglang_meta(req, tokenizer, with_text: bool) -> dict:
    entries = req.output_logprobs
    text = (lambda t: _text(tokenizer, t)) if with_text else (lambda t: None)
    out = {"output_token_logprobs": [[lp, tok, text(tok)] for tok, (lp, _) in zip(req.output_ids, entries)],
           "output_top_logprobs": [[[x, t, text(t)] for t, x in top] for _, top in entries]}
    if req.prompt_logprobs_from is not None:
        ids = req.input_ids[req.prompt_logprobs_from:]
        out["input_token_logprobs"] = [[None if e is None else e[0], tok, text(tok)]
                                       for tok, e in zip(ids, req.prompt_logprobs)]
        out["input_top_logprobs"] = [None if e is None else [[x, t, text(t)] for t, x in e[1]]
                                     for e in req.prompt_logprobs]
    return out


def completion_logprobs(req, tokenizer, start: int = 0, end: int | None = None, offset: int = 0,
                        echo: bool = False) -> dict:
    """Tokens [start, end) of the output, after the prompt's own with `echo` (the first
    prompt token's logprob is null: nothing predicts it); `offset`: the text length
    before them."""
    ids = req.output_ids[start:end]
    entries = list(req.output_logprobs[start:end])
    if echo:
        ids = list(req.input_ids) + ids
        entries = list(req.prompt_logprobs) + entries
    tokens = [_text(tokenizer, t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else {_text(tokenizer, t): x for t, x in e[1]} for e in entries],
            "text_offset": offsets}


def chat_logprobs(req, tokenizer, start: int = 0, end: int | None = None) -> dict:
    def entry(tok: int, lp: float) -> dict:
        t = _text(tokenizer, tok)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**entry(tok, lp), "top_logprobs": [entry(t, x) for t, x in top]}
                        for tok, (lp, top) in zip(req.output_ids[start:end], req.output_logprobs[start:end])]}
