"""benchmarks/engine_ab.py, benchmarks/threads.py and benchmarks/decode_step.py run end
to end on the embedded model with tiny settings: they print their tables and one JSON
line, and each A/B change's two passes give identical replies."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, tmp_path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def ab(change: str, *args: str, tmp_path) -> tuple[str, dict]:
    out = run_script("engine_ab.py", change, "--model-path", "tiny-hybrid", "--clients", "3", "--rounds", "2",
                     "--tokens-per-round", "24", "--output-tokens", "3", "--page-size", "4", "--repeats", "1",
                     *args, tmp_path=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["replies_identical"] is True and result["errors"] == 0
    return out, result


def test_head_rows_ab_compares_identical_replies(tmp_path):
    out, result = ab("head-rows", "--shared-prefix-tokens", "40", tmp_path=tmp_path)
    assert "every row" in out and "sampled rows" in out
    assert result["baseline"]["all"]["hit_rate"] == result["change_on"]["all"]["hit_rate"] > 0


def test_prefix_sharing_ab_reuses_the_preamble_in_round_one(tmp_path):
    """Three clients open with one 96-token preamble at once: with sharing the two later
    ones resume after it in round 1 (2 x 96 of the prompt tokens), without it none do."""
    out, result = ab("prefix-sharing", "--shared-prefix-tokens", "96", "--first-round-tokens", "20",
                     tmp_path=tmp_path)
    assert "no sharing" in out
    assert result["baseline"]["round1"]["hit_rate"] == 0
    assert result["change_on"]["round1"]["hit_rate"] >= 2 * 96 / (3 * (96 + 20) + 30)
    assert result["shared_prefixes"][0] >= 1


def test_threads_benchmark_measures_idle_and_busy(tmp_path):
    out = run_script("threads.py", "--model-path", "tiny-hybrid", "--threads", "1,2", "--prompt", "32",
                     "--decode", "2", "--repeats", "1", "--busy", "1", tmp_path=tmp_path)
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [(r["machine"], r["threads"]) for r in rows] == [("idle", 1), ("idle", 2), ("busy", 1), ("busy", 2)]
    assert all(r["prefill_tok_s"] > 0 and r["decode_ms"] > 0 for r in rows)


def test_kernels_ab_runs_both_kernels(tmp_path):
    """The row-invariant kernels against torch's in one process (kernels.off() for the
    baseline): the same hit rate; replies may differ only where greedy meets a near tie,
    so they are not compared here."""
    out = run_script("engine_ab.py", "kernels", "--model-path", "tiny-hybrid", "--clients", "2", "--rounds", "2",
                     "--tokens-per-round", "24", "--output-tokens", "3", "--page-size", "4", "--repeats", "1",
                     tmp_path=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert "torch's kernels" in out and "row-invariant kernels" in out and result["errors"] == 0
    assert result["baseline"]["all"]["hit_rate"] == result["change_on"]["all"]["hit_rate"] > 0


def test_decode_step_measures_its_floor_the_cpu_and_the_split(tmp_path):
    """benchmarks/decode_step.py: each row is set against its floor (the bytes a step
    reads, over the bandwidth measured in the same run), the CPU's flags and the kernels
    line come with it, and the split (the kernels timed by wrapping them, torch's ops by
    the profiler, the rest Python) adds up to the step. No timing verdict: the figures
    only have to be what they say."""
    import torch
    from uniradix.model import load_model

    import platform
    isa = ["--isa", "x86-64"] if platform.machine() in ("x86_64", "AMD64") else []  # the scalar build beside
    out = run_script("decode_step.py", "--model-path", "tiny-hybrid", "--batches", "1,2", "--steps", "2",
                     "--prompt", "16", "--bandwidth-mb", "8", "--threads", "1", *isa, tmp_path=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["cpu"]["flags"]) == {"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile"}
    assert result["cpu"]["model"] and result["kernels"] and result["threads"] == 1
    bw = result["bandwidth"]
    assert bw["one_core_gbs"] > 0 and bw["threads_gbs"] > 0 and bw["best_gbs"] >= bw["threads_gbs"]
    (prec,) = result["precisions"]
    assert prec["dtype"] == "float32" and prec["quantization"] == "none" and prec["bandwidth_gbs"] > 0

    # the bytes: every weight the step multiplies by (the separate head included), one
    # embedding row per request, keys and values per request
    model = load_model("tiny-hybrid")
    leaves = [t for k, t in model.weights.items() if k != "layers"] + \
        [t for layer in model.weights["layers"] for t in layer.values()]
    all_bytes = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    embed = model.weights["embed"]
    one, two = prec["rows"]
    assert (one["batch"], two["batch"]) == (1, 2)
    assert one["bytes"]["weights"] == two["bytes"]["weights"] == all_bytes - embed.numel() * embed.element_size()
    assert one["bytes"]["embedding"] == embed.shape[1] * embed.element_size() and \
        two["bytes"]["embedding"] == 2 * one["bytes"]["embedding"]
    assert one["bytes"]["kv"] > 0 and two["bytes"]["kv"] == 2 * one["bytes"]["kv"]
    assert prec["bytes_batch1"] == one["bytes"] and prec["floor_ms"] > 0

    for row in prec["rows"]:
        assert row["floor_ms"] > 0 and row["x_floor"] > 0 and row["x_floor_best"] > 0
        assert abs(row["x_floor"] - row["step_ms"] / row["floor_ms"]) < 1e-9 * row["x_floor"]
        assert row["floor_ms"] == row["bytes"]["total"] / (prec["bandwidth_gbs"] * 1e9) * 1e3
        parts = row["parts_ms"]
        assert set(parts) == {"products", "attention", "activations", "recurrences", "other ops", "Python"}
        assert all(v >= 0 for v in parts.values()) and abs(sum(parts.values()) - row["step_ms"]) < 1e-6 * row["step_ms"]
        assert row["glue_ms"] > 0  # the step with the kernels' calls stubbed, measured apart
        if result["kernels"].startswith("row-invariant"):  # the kernels' calls were timed, not missed
            assert row["kernel_calls"]["linear"] > 0 and parts["products"] > 0
    assert one["step_ratio"] == 1.0 and two["step_ratio"] > 0
    if isa:  # every other step on the other build
        assert result["isa"] == "x86-64" and all(row["isa_step_ms"] > 0 for row in prec["rows"])
        assert "x x86-64" in out
    assert "x floor" in out and "avx2" in out and result["kernels"] in out


def test_the_split_times_the_greedy_heads_pass_as_products():
    """decode_step's split wraps the greedy head's int8 pass (a method, not a module
    function) like the kernels: its time and calls are counted, as products, and the
    method is itself again after."""
    import pytest
    import torch
    from uniradix.model import kernels
    if not kernels.available():
        pytest.skip("the row-invariant kernels are not built here")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode_step
    from collections import defaultdict
    gh = kernels.GreedyHead(kernels.PackedWeight(torch.randn(64, 16)))
    before = kernels.GreedyHead.candidates
    seconds, calls = defaultdict(float), defaultdict(int)
    with decode_step.timed_kernels(seconds, calls):
        gh.argmax(torch.randn(3, 16))
    assert calls["greedy_head"] == 1 and seconds["greedy_head"] > 0
    assert calls["linear"] == 1   # the candidates computed exactly, after the pass
    assert decode_step.KERNEL_PARTS["greedy_head"] == "products"
    assert kernels.GreedyHead.candidates is before


def test_floor_bytes_read_a_shared_table_once_and_each_window_at_most():
    """memory_floor.step_bytes: a head that is the embedding's very table (the GGUF read
    as stored) is read once, in full; a separate head and the embedding's looked-up rows
    otherwise; greedy rows read the greedy head's copy in the head's stead; a window
    layer's keys stop at its window, a full layer's grow with depth."""
    import torch
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_floor
    from uniradix.specs import FullKV, KVShape, LayerState, ModelStates, SlidingWindowKV

    full, swa = FullKV(), SlidingWindowKV(window=4)
    kv = KVShape(2, 8, "bfloat16")
    states = ModelStates(((full, (LayerState(0, full, kv),)), (swa, (LayerState(1, swa, kv),))))

    class Model:
        embed_weight = "embed"

        def __init__(self, weights, head):
            self.weights, self.lm_head = weights, head

        def states(self):
            return states

    table, proj, norm = torch.zeros(100, 16), torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(16)
    tied = memory_floor.step_bytes(Model({"embed": table, "lm_head.weight": table, "proj": proj, "norm": norm},
                                         table), batch=1, depth=10)
    assert tied["weights"] == 100 * 16 * 4 + 16 * 16 * 2 + 16 * 4 and tied["embedding"] == 0
    own = torch.zeros(100, 16, dtype=torch.bfloat16)  # a head of its own, outside the weights dict
    sep = memory_floor.step_bytes(Model({"embed": table, "proj": proj}, own), batch=3, depth=10)
    assert sep["weights"] == 100 * 16 * 2 + 16 * 16 * 2 and sep["embedding"] == 3 * 16 * 4
    per_key = 2 * 2 * 8 * 2  # keys and values, 2 heads of 8, bfloat16
    assert sep["kv"] == 3 * per_key * (11 + 4) and sep["total"] == sep["weights"] + sep["embedding"] + sep["kv"]

    class Greedy:  # a greedy head's int8 copy: what greedy rows read instead of the head
        def nbytes(self):
            return 777

    class WithGreedy(Model):
        def greedy_head(self):
            return Greedy()

    named = {"embed": table, "lm_head.weight": own, "proj": proj}   # the head in the weights dict, read once
    assert memory_floor.step_bytes(Model(named, own), 1, 10)["weights"] == 100 * 16 * 2 + 16 * 16 * 2
    fast = memory_floor.step_bytes(WithGreedy(named, own), batch=1, depth=10)
    assert fast["weights"] == 777 + 16 * 16 * 2
    assert memory_floor.step_bytes(WithGreedy(named, own), 1, 10, greedy=False)["weights"] == sep["weights"]


def test_capacity_counts_conversations_in_a_budget_for_both_splits(tmp_path):
    """benchmarks/capacity.py on the embedded Gemma-like layers: the derived split holds
    more conversations of the same length in the same budget than 1:1 (its window pool
    keeps only what the workload needs), each split within the budget, and the hit rates
    when twice as many come back are fractions, with no error, the tiers never below L1."""
    out = run_script("capacity.py", "--model-path", "gemma3-like", "--budget-gib", "0.002", "--lengths", "512",
                     "--page-size", "4", tmp_path=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    rows = result["lengths"]["512"]
    one, derived = rows["1:1 (old default)"], rows["derived (new default)"]
    assert 1 <= one["capacity"] < derived["capacity"]
    assert one["split"]["full"]["tokens"] == one["split"]["swa"]["tokens"] == result["max_total_tokens"] // 4 * 4
    assert derived["split"]["full"]["tokens"] > one["split"]["full"]["tokens"] > derived["split"]["swa"]["tokens"]
    for row in (one, derived):
        assert sum(p["GiB"] for p in row["split"].values()) <= 0.002 * 1.0001
        for tiers in row["come_back"].values():
            assert all(t["errors"] == 0 and 0.0 <= t["hit_rate"] <= 1.0 for t in tiers.values())
            assert tiers["L1"]["hit_rate"] <= tiers["L1+L2"]["hit_rate"] <= tiers["L1+L2+L3"]["hit_rate"]
    assert "| 512 | derived (new default) |" in out


def test_speculative_benchmark_serves_each_workload_both_ways(tmp_path):
    """benchmarks/speculative.py on the embedded model: every workload served with
    speculation off and on, the replies and the hit rate of every round the same, the
    drafts' figures reported (no timing verdict)."""
    out = run_script("speculative.py", "--model-path", "tiny-hybrid", "--turns", "2", "--output-tokens", "12",
                     "--repeats", "1", "--threads", "1", tmp_path=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["cpu"]["flags"] and result["threads"] == 1
    modes = ["off", "ngram", "suffix", "both"]
    assert [(r["workload"], r["mode"]) for r in result["results"]] == \
        [(w, m) for w in ("chat", "agentic", "document") for m in modes]
    for r in result["results"]:
        assert r["replies_same"] and r["hit_rates_same"], r
        assert len(r["hit_rates"]) == 4 and r["hit_rates"][1] > 0   # 2 conversations x 2 turns
        assert r["output_tps"] > 0 and r["speedup"] > 0 and r["slowest_turn"] > 0
        if r["mode"] == "off":
            assert r["verify_steps"] == 0 and r["acceptance"] is None and r["speedup"] == 1
            assert r["slowest_turn"] == 1
        elif r["verify_steps"]:
            assert 0 <= r["acceptance"] <= 1 and r["tokens_per_verify"] >= 1
    assert any(r["verify_steps"] for r in result["results"] if r["mode"] == "ngram")
