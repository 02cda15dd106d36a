"""`uniradix run --model-path DIR` serves the multi-turn workload on a real checkpoint,
as chat: text in through its chat template, text out through its tokenizer."""
import json

import pytest
from harness import COMMON, make_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    S, F = "sliding_attention", "full_attention"
    cfg = Gemma3TextConfig(**COMMON, num_hidden_layers=3, head_dim=16, layer_types=[S, S, F],
                           sliding_window=16, query_pre_attn_scalar=16)
    return make_checkpoint(str(tmp_path_factory.mktemp("run-gemma3")), Gemma3ForCausalLM, cfg)


def test_run_serves_a_checkpoint_as_chat(checkpoint, capsys):
    from uniradix.cli import main
    args = ["run", "--model-path", checkpoint, "--clients", "2", "--rounds", "3", "--tokens-per-round", "12",
            "--output-tokens", "4", "--shared-prefix-tokens", "16", "--page-size", "4", "--no-progress"]
    assert main([*args, "--json"]) == 0
    rounds = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rounds"]
    assert rounds[0]["errors"] == 0 and rounds[1]["cached_tokens"] > 0.5 * rounds[1]["prompt_tokens"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gemma3_text from" in out and "chat" in out
    assert "client 0, last turn:" in out and "user:" in out and "assistant:" in out


def test_an_unsupported_architecture_is_refused_by_name(tmp_path, capsys):
    from uniradix.cli import main
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert main(["run", "--model-path", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'bert'" in err and "BertModel" in err and "supported:" in err and "gemma3_text" in err
