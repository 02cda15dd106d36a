"""The context length: a request spans at most the model's context (its config's
max_position_embeddings, or --context-length), prompt L plus n new tokens with
L + n <= context. A count the caller gave that does not fit is refused with both
lengths named; a default the caller did not choose is shortened to the room left; a
prompt that leaves no room for one token is refused either way. A context longer than
the model's own needs --allow-longer-context."""
import json
import sys
from pathlib import Path

import pytest

from uniradix.engine import Engine, Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model" / "hf"))

CTX = 64


def ids(n: int) -> list[int]:
    return [3 + i % 200 for i in range(n)]


def run(eng, n_prompt: int, **sampling) -> Request:
    return eng.run([Request(input_ids=ids(n_prompt), sampling=SamplingParams(temperature=0, **sampling))])[0]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_plus_new_tokens_may_fill_the_context_exactly(make_engine, page_size):
    eng = make_engine(context_length=CTX, page_size=page_size)
    r = run(eng, CTX - 5, max_new_tokens=5)
    assert r.status == "finished" and len(r.output_ids) == 5
    r = run(eng, CTX - 5, max_new_tokens=6)
    assert r.status == "error" and r.output_ids == []
    assert f"{CTX - 5} prompt tokens + 6 max_new_tokens = {CTX + 1} tokens" in r.error
    assert f"{CTX} tokens" in r.error and "--context-length" in r.error


def test_a_default_count_is_shortened_to_the_room_left(make_engine):
    eng = make_engine(context_length=CTX)
    r = run(eng, CTX - 3)  # no max_new_tokens: the default (16) does not fit, 3 do
    assert r.status == "finished" and len(r.output_ids) == 3 and r.finish_reason == "length"
    r = run(eng, CTX - 40)  # room for more than the default: the default stands
    assert len(r.output_ids) == SamplingParams().max_new_tokens == 16
    r = run(eng, CTX - 3, max_new_tokens=16, fit_context=True)  # a server's own default, marked as such
    assert len(r.output_ids) == 3
    for n_prompt in (CTX, CTX + 10):  # the prompt alone leaves no room: refused even so
        r = run(eng, n_prompt)
        assert r.status == "error" and f"its {n_prompt} prompt tokens leave no room" in r.error
        assert f"{CTX} tokens" in r.error


def test_prepare_refuses_before_anything_is_queued(make_engine):
    eng = make_engine(context_length=CTX)
    req = Request(input_ids=ids(CTX), sampling=SamplingParams(max_new_tokens=1))
    why = eng.prepare(req)
    assert why and "no room" in why
    assert not eng.waiting and eng.stats()["prompt_tokens"] == 0


def test_the_embedded_model_has_no_bound_of_its_own(make_engine):
    eng = make_engine()
    assert eng.context_length is None and eng.model.context_length is None
    assert run(eng, 300, max_new_tokens=2).status == "finished"


def test_a_checkpoint_declares_its_context(make_engine, tmp_path):
    pytest.importorskip("transformers")
    from harness import make_tiny

    from uniradix.model.hf import load_checkpoint
    path = Path(make_tiny("qwen3", str(tmp_path / "ckpt")))
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_checkpoint(str(path))
    assert model.context_length == 48
    eng = make_engine(model, page_size=4)
    assert eng.context_length == 48
    assert run(eng, 44, max_new_tokens=4).status == "finished"
    r = run(eng, 44, max_new_tokens=5)
    assert r.status == "error" and "49 tokens" in r.error and "the model's context length of 48 tokens" in r.error
    assert make_engine(model, page_size=4, context_length=32).context_length == 32  # shorter: the operator's
    with pytest.raises(ValueError, match="--allow-longer-context"):
        Engine(model, page_size=4, context_length=100)
    longer = make_engine(model, page_size=4, context_length=100, allow_longer_context=True)
    assert longer.context_length == 100 and run(longer, 60, max_new_tokens=4).status == "finished"


def test_bad_settings_are_refused():
    for bad in (0, 1, -5, 2.5, "64", True):
        with pytest.raises(ValueError, match="--context-length"):
            Engine("tiny-hybrid", context_length=bad)
    with pytest.raises(ValueError, match="fit_context"):
        SamplingParams(fit_context="yes")


def test_uniradix_run_refuses_a_turn_past_the_context(capsys):
    from uniradix.cli import main
    args = ["run", "--context-length", "40", "--clients", "1", "--rounds", "2", "--first-round-tokens", "20",
            "--tokens-per-round", "8", "--output-tokens", "8", "--shared-prefix-tokens", "0", "--no-progress"]
    assert main(args) == 1  # round 2: 20 + 8 + 8 = 36 prompt tokens + 8 new = 44 > 40
    err = capsys.readouterr().err
    assert "36 prompt tokens + 8 max_new_tokens = 44 tokens" in err and "of 40 tokens" in err
