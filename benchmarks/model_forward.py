"""The cost of paging and capture: prefill and decode throughput of uniradix's paged
forward against transformers' own forward on the same tokens, per family, in one run.

Each family's tiny random checkpoint (tests/model/hf/harness.py: transformers' own
config classes) is loaded by both. Prefill: one request of --prompt tokens from empty
pools (uniradix captures the recurrent state halfway, as the engine does at a resume
point); transformers runs the same tokens with no cache. Decode: --decode single-token
steps after a --prompt prefill; transformers with its own cache and explicit position
ids. --repeats back-to-back pairs (ours, theirs; the order alternating): medians of each
side, and the ratio is the median of the pairs' ratios (throughput, ours over theirs). transformers is a test
dependency: `pip install -e ".[test]"`.

    python benchmarks/model_forward.py [--families gemma3,qwen3_next] [--prompt 256]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "model" / "hf"))
sys.path.insert(0, str(ROOT / "tests" / "engine"))


def once(fn) -> float:
    """Seconds of one fn() (a function that returns a number times itself: the part
    after its own setup)."""
    t0 = time.perf_counter()
    inner = fn()
    return inner if isinstance(inner, float) else time.perf_counter() - t0


def paired(a, b, repeats: int) -> tuple[float, float, float]:
    """Median seconds of a() and of b(), and the median of a's time over b's, from
    `repeats` back-to-back pairs (after one warm-up each; the order alternates): on a
    busy machine a slow spell then lands on both sides of a pair, not on one side."""
    a(), b()
    ta, tb, ratio = [], [], []
    for k in range(repeats):
        if k % 2:
            y, x = once(b), once(a)
        else:
            x, y = once(a), once(b)
        ta.append(x)
        tb.append(y)
        ratio.append(x / y)
    return statistics.median(ta), statistics.median(tb), statistics.median(ratio)


def ours(path: str, tokens: list[int], decode: int, page: int):
    """(prefill seconds, decode seconds) closures for uniradix's paged forward."""
    from uniradix.engine import build_cache
    from uniradix.model import PagedInput
    from uniradix.model.hf import load_checkpoint
    model = load_checkpoint(path)
    n = len(tokens) + decode + page
    cache, pools = build_cache(model, page_size=page, max_total_tokens=4 * n, max_mamba_cache_size=8)
    page_pools = {name: p for name, p in pools.items() if hasattr(p, "page_size")}
    npages = -(-n // page)
    pages = {name: p.alloc(npages) for name, p in page_pools.items()}
    state = cache.pools[cache.ckpt.index] if cache.ckpt is not None else None
    slots = state.alloc(2) if state is not None else (None, None)
    half = len(tokens) // 2 // page * page

    def prefill():
        if state is not None:
            state.zero_slots([slots[0]])
        cap = {half: slots[1]} if state is not None and half else {}
        model.forward(pools, [PagedInput(tokens, 0, pages, slots[0], cap)])

    def steps() -> float:
        prefill()
        t0 = time.perf_counter()
        for k in range(decode):
            pos = len(tokens) + k
            model.forward(pools, [PagedInput([tokens[k % len(tokens)]], pos, pages, slots[0])])
        return time.perf_counter() - t0

    return prefill, steps


def theirs(path: str, tokens: list[int], decode: int):
    """The same for transformers: no-cache prefill, cached decode."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.as_tensor([tokens])
    pos = torch.arange(len(tokens))[None]

    @torch.no_grad()
    def prefill():
        model(input_ids=ids, position_ids=pos, use_cache=False)

    @torch.no_grad()
    def steps() -> float:
        out = model(input_ids=ids, position_ids=pos, use_cache=True)
        cache = out.past_key_values
        t0 = time.perf_counter()
        for k in range(decode):
            p = len(tokens) + k
            out = model(input_ids=torch.as_tensor([[tokens[k % len(tokens)]]]), position_ids=torch.as_tensor([[p]]),
                        past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        return time.perf_counter() - t0

    return prefill, steps


def main() -> None:
    import harness
    from uniradix.model.hf import families
    served = {t for f in families() for t in f.model_types}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(harness.TINY), help="comma list of harness.TINY names")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    import random
    rng = random.Random(0)
    tokens = [rng.randrange(8, harness.V) for _ in range(a.prompt)]
    rows = []
    print(f"prompt {a.prompt} tokens, {a.decode} decode steps, page size {a.page_size}, float32, "
          f"{torch.get_num_threads()} torch threads; {a.repeats} back-to-back pairs, medians")
    print(f"{'family':<16}{'prefill tok/s ours':>20}{'transformers':>14}{'ratio':>7}"
          f"{'decode tok/s ours':>20}{'transformers':>14}{'ratio':>7}")
    for name in a.families.split(","):
        path = harness.make_tiny(name, tempfile.mkdtemp(prefix=f"mf-{name}-"))
        mt = json.load(open(Path(path) / "config.json"))["model_type"]
        if mt not in served:
            print(f"{name:<16}(not served yet: {mt})")
            continue
        op, od = ours(path, tokens, a.decode, a.page_size)
        tp, td = theirs(path, tokens, a.decode)
        po, ph, pr = paired(op, tp, a.repeats)
        do, dh, dr = paired(od, td, a.repeats)
        r = dict(family=name, prefill_ours=a.prompt / po, prefill_hf=a.prompt / ph, prefill_ratio=1 / pr,
                 decode_ours=a.decode / do, decode_hf=a.decode / dh, decode_ratio=1 / dr)
        rows.append(r)
        print(f"{name:<16}{r['prefill_ours']:>20,.0f}{r['prefill_hf']:>14,.0f}{r['prefill_ratio']:>7.2f}"
              f"{r['decode_ours']:>20,.0f}{r['decode_hf']:>14,.0f}{r['decode_ratio']:>7.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
