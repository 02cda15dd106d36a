"""`uniradix run --model-path DIR` serves the multi-turn workload on a real checkpoint,
as chat: text in through its chat template, text out through its tokenizer."""
import json

import pytest
from harness import TINY, make_tiny

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", list(TINY))
def test_run_serves_a_checkpoint_as_chat(family, tmp_path, capsys):
    from uniradix.cli import main
    checkpoint = make_tiny(family, str(tmp_path / family))
    model_type = json.loads((tmp_path / family / "config.json").read_text())["model_type"]
    args = ["run", "--model-path", checkpoint, "--clients", "2", "--rounds", "3", "--tokens-per-round", "12",
            "--output-tokens", "4", "--shared-prefix-tokens", "16", "--page-size", "4", "--no-progress"]
    assert main([*args, "--json"]) == 0
    rounds = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rounds"]
    assert all(r["errors"] == 0 for r in rounds)
    assert rounds[1]["cached_tokens"] > 0.5 * rounds[1]["prompt_tokens"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{model_type} from" in out and "chat" in out
    assert "client 0, last turn:" in out and "user:" in out and "assistant:" in out


def test_an_unsupported_architecture_is_refused_by_name(tmp_path, capsys):
    from uniradix.cli import main
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert main(["run", "--model-path", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'bert'" in err and "BertModel" in err and "supported:" in err and "gemma3_text" in err
