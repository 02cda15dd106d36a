"""`uniradix`: command-line entry points. `uniradix run` serves a multi-turn workload
on the embedded reference model and prints the hit rate, TTFT and input throughput
per round; `uniradix serve` is the HTTP server (uniradix.server). Engine flags follow
SGLang's names."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .engine.flags import add_engine_args, engine_from_args, pools_line, threads_from_args
from .engine.speculation import tokens_a_verify


def add_workload_args(p: argparse.ArgumentParser) -> None:
    from .bench import MultiTurnWorkload
    from .config import add_flags
    add_flags(p, MultiTurnWorkload, "multi-turn workload")


def workload_from_args(a: argparse.Namespace):
    from .bench import MultiTurnWorkload
    from .config import from_args
    return from_args(MultiTurnWorkload, a)


def cmd_run(a: argparse.Namespace) -> int:
    from .bench import run_multiturn
    from .redact import redact, redact_logs
    redact_logs()  # a backend's warning or error that echoes a URL is masked
    try:
        wl = workload_from_args(a)
        threads = threads_from_args(a)
        engine = engine_from_args(a, lambda line: print(f"uniradix run: {line}", file=sys.stderr, flush=True))
    except (ValueError, OSError, ImportError, RuntimeError) as e:  # RuntimeError: StorageUnavailable
        print(f"uniradix run: {redact(e)}", file=sys.stderr)
        return 2
    model = engine.model
    chat = model.tokenizer if getattr(model.tokenizer, "chat_template", None) else None
    layers = " ".join(f"{spec.name} x{len(ls)}" for spec, ls in model.states().groups if ls)
    what = a.model_preset if model.name == "reference" else \
        f"{model.name} from {a.model_path} in {a.dtype}" + \
        {"none": "", "stored": ", linear weights quantized as the file stores them"}.get(
            a.quantization, f", {a.quantization} linear weights")
    print(f"uniradix run: {what} ({layers}), page size {a.page_size}, "
          f"{wl.clients} clients x {wl.rounds} rounds, {wl.tokens_per_round} new tokens and "
          f"{wl.output_tokens} output tokens per round, shared prefix {wl.shared_prefix_tokens}"
          f"{', chat' if chat else ''}, cache {'off' if a.disable_radix_cache else 'on'}, device {engine.device}, "
          f"{threads}", file=sys.stderr if a.json else sys.stdout)  # with --json, stdout is the JSON document alone
    print(f"uniradix run: {pools_line(engine)}", file=sys.stderr if a.json else sys.stdout)
    bar = None
    if not a.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=wl.requests, desc="requests", unit="req", file=sys.stderr, leave=False)
    try:
        transcript: list = []
        reports = run_multiturn(engine, wl, (lambda r: bar.update(1)) if bar else None, chat, transcript)
    finally:
        engine.close()  # and the backend it opened: it reports what it has not logged yet
        if bar:
            bar.close()
    failed = sum(r.errors for r in reports)
    if a.json:
        print(redact(json.dumps({"rounds": [r.as_dict() for r in reports], "engine": _plain(engine.stats())})))
    else:
        _print_rounds(reports)
        _print_engine(engine, a)
        if transcript:
            last = [m for m in transcript if m["role"] in ("user", "assistant")][-2:]
            print("client 0, last turn:\n" + "\n".join(f"  {m['role']}: {m['content']!r}" for m in last))
    if failed:
        why = list(dict.fromkeys(redact(m) for r in reports for m in r.error_messages))
        print(f"uniradix run: {failed} of {sum(r.requests for r in reports)} requests failed; "
              f"{'the reason' if len(why) == 1 else 'reasons'}: " + "; ".join(why[:3])
              + (f" (and {len(why) - 3} more)" if len(why) > 3 else ""), file=sys.stderr)
        return 1
    return 0


def _fmt(x, spec: str, width: int) -> str:
    """A figure, or '-' where there is none (a round that served nothing)."""
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def _print_rounds(reports) -> None:
    print(f"{'round':>5} {'prompt tok':>10} {'cached tok':>10} {'hit rate':>8} "
          f"{'TTFT ms':>8} {'input tok/s':>11} {'errors':>6}")
    for r in reports:
        ttft = None if r.ttft_mean is None else r.ttft_mean * 1e3
        print(f"{r.round:>5} {r.prompt_tokens:>10} {r.cached_tokens:>10} {_fmt(r.hit_rate, '.1%', 8)} "
              f"{_fmt(ttft, '.1f', 8)} {_fmt(r.input_throughput, ',.0f', 11)} {r.errors:>6}")
    tp = sum(r.prompt_tokens for r in reports)
    tc = sum(r.cached_tokens for r in reports)
    wall = sum(r.wall_s for r in reports if r.served)
    ttfts = [t for r in reports for t in r.ttfts]
    print(f"{'all':>5} {tp:>10} {tc:>10} {_fmt(tc / tp if tp else None, '.1%', 8)} "
          f"{_fmt(sum(ttfts) / len(ttfts) * 1e3 if ttfts else None, '.1f', 8)} "
          f"{_fmt(tp / wall if tp and wall > 0 else None, ',.0f', 11)} {sum(r.errors for r in reports):>6}")


def _print_engine(engine, a) -> None:
    s = engine.stats()
    first = engine.cache.tree.structural.name  # the component that shapes the tree (FULL)
    ev = s["cache"]["components"][first]["evicted"]
    print(f"hit rate = cached prefix tokens / prompt tokens of the requests served, summed per round; "
          f"input tok/s counts cached tokens too.\nengine: {s['prefill_tokens']} prefill and {s['decode_tokens']} decode "
          f"tokens computed, {s['preemptions']} preemptions, {ev} FULL pages evicted, {s['errors']} errors")
    if engine.spec is not None:
        steps = s["spec_verify_steps"]
        print(f"speculation ({engine.spec.speculative_algorithm}): {s['spec_accepted_tokens']} of "
              f"{s['spec_draft_tokens']} drafts kept in {steps} verify steps"
              + (f", {tokens_a_verify(s['spec_accepted_tokens'], steps):.2f} tokens a verify step" if steps else ""))
    if engine.hierarchical:
        h = s["cache"]["host"]
        full = s["cache"]["components"][first]
        print(f"L2 (host, {full['host_pool_size']} FULL pages): {s['host_tokens']} prompt tokens loaded back "
              f"in {h['loads']} loads ({h['failed_loads']} could not fit), {h['written_handles'] + h['written_back']} "
              f"handles written ({a.hicache_write_policy}), {full['offloaded']} FULL pages left the device "
              f"as host copies, {full['host_evicted']} host pages evicted")
    if a.hicache_storage_backend:
        print(f"L3 ({a.hicache_storage_backend}): {s['storage_tokens']} prompt tokens loaded in "
              f"{s['storage_loads']} loads ({s['storage_failed_loads']} failed), "
              f"{s['storage_saved_objects']} objects written, {s['storage_errors']} errors")


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool)) or x is None else str(x)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: not for flags whose help already says it, nor None/False."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or action.default in (None, False):
            return h
        return super()._get_help_string(action)


#: flags of other servers that split one model over several devices or copies, which
#: one uniradix process does not do (it serves one device; several are a fleet)
PARALLEL_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size", "--dp", "--dp-size", "--data-parallel-size",
                  "--pp", "--pp-size", "--pipeline-parallel-size", "--ep", "--ep-size", "--expert-parallel-size")


def _unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit with the subcommand's own usage for flags it does not take, and what to do
    instead for the parallelism flags SGLang and vLLM users bring."""
    par = [x for x in extra if x.split("=", 1)[0] in PARALLEL_FLAGS]
    if par:
        parser.error(f"{par[0].split('=', 1)[0]}: one uniradix process serves one device and one copy of the "
                     "model; for several, run one `uniradix serve` per device behind SGLang's gateway (smg), "
                     "sharing an L3 store (docs/fleet.md)")
    parser.error(f"unrecognized arguments: {' '.join(extra)}")


def main(argv=None) -> int:
    from . import installed_version
    p = argparse.ArgumentParser(prog="uniradix", description=__doc__)
    p.add_argument("--version", action="version", version=f"uniradix {installed_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", formatter_class=_HelpFormatter, help="serve a multi-turn workload on the embedded model; print hit rate, "
                                   "TTFT and input throughput per round")
    add_engine_args(r)
    add_workload_args(r)
    r.add_argument("--json", action="store_true", help="print the rounds as JSON instead of a table")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)
    from .server.serve import add_serve_args, cmd_serve
    s = sub.add_parser("serve", formatter_class=_HelpFormatter,
                       help="serve SGLang's and OpenAI's HTTP APIs (sessions, /metrics) on 127.0.0.1")
    add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    from .bench import hit_rate
    h = sub.add_parser("hit-rate", formatter_class=_HelpFormatter,
                       help="the hit rate of a request log (--request-log, or any JSONL with prompt and cached "
                            "token counts) by round, hour and session, summed, never a mean of ratios")
    hit_rate.add_args(h)
    h.set_defaults(func=hit_rate.main)
    from .bench import simulate
    sm = sub.add_parser("simulate", formatter_class=_HelpFormatter,
                        help="replay a request log with token ids on the real scheduler and cache, nothing "
                             "computed, for a grid of pool sizes, tiers, page sizes and eviction policies")
    simulate.add_args(sm)
    sm.set_defaults(func=simulate.main)
    from .bench import http_multiturn
    b = sub.add_parser("bench", formatter_class=_HelpFormatter, help="clients that measure a running server")
    bsub = b.add_subparsers(dest="bench", required=True)
    m = bsub.add_parser("multiturn", formatter_class=_HelpFormatter,
                        help="the multi-turn workload over HTTP against any SGLang- or OpenAI-compatible server: "
                             "hit rate, TTFT and input throughput per round")
    http_multiturn.add_args(m)
    m.set_defaults(func=http_multiturn.main)
    a, extra = p.parse_known_args(argv)
    if extra:
        _unknown({"run": r, "serve": s, "hit-rate": h, "simulate": sm, "bench": m}[a.cmd], extra)
    from .stderr_relay import masked_stderr
    with masked_stderr():  # what native libraries print is masked too (uniradix.redact)
        code = a.func(a)
    if a.cmd == "serve":
        _end_past_stuck_storage_calls(code)
    return code


def _end_past_stuck_storage_calls(code: int) -> None:
    """A server whose store stopped answering can end with a call still inside the
    store's native client (Mooncake's): the interpreter's teardown would then run that
    library's under it, which waits for the library's own timeouts (tens of seconds)
    and can crash (SIGSEGV) instead of exiting with the server's status. So the process
    ends here, its output flushed, leaving those calls where they are."""
    from .hicache.io_threads import calls_in_progress
    n = calls_in_progress()
    if not n:
        return
    logging.getLogger("uniradix.server").warning("%d L3 call(s) still stuck in the store at exit: "
                                                 "not waited for", n)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
