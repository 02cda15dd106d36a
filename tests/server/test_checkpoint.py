"""`uniradix serve --model-path DIR` on a real architecture's tiny checkpoint: chat
through the checkpoint's own template, eos ids from its generation config, reuse on
the next turn, and the same tokens as the engine run in-process with the cache off."""
import sys
from pathlib import Path

import pytest
from server_proc import ServerProc

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model" / "hf"))
from harness import make_tiny  # noqa: E402


def test_serve_a_hybrid_checkpoint_as_chat(tmp_path):
    from uniradix.engine import Engine
    from uniradix.model.hf import load_checkpoint
    path = make_tiny("qwen3_next", str(tmp_path / "ckpt"))
    s = ServerProc("--model-path", path, "--page-size", "4")
    try:
        status, info, _ = s.get("/get_model_info")
        assert status == 200 and info["has_chat_template"] and set(info["layers"]) >= {"full", "mamba"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == path
        msgs = [{"role": "user", "content": "hello there, how are you"}]
        first = client.chat.completions.create(model=path, messages=msgs, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        msgs2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "and a second question"}]
        second = client.chat.completions.create(model=path, messages=msgs2, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        model = load_checkpoint(path)
        ids = model.tokenizer.encode_chat(msgs2)
        assert second.usage.prompt_tokens == len(ids)
        alone = Engine(model, disable_radix_cache=True, page_size=4).generate(input_ids=ids, max_new_tokens=6)
        assert second.choices[0].message.content == model.tokenizer.decode(alone.output_ids)
        assert s.audit()["ok"]
    finally:
        assert s.stop() == 0
