"""The OpenAI API through the real `openai` client: models, completions, chat, streaming,
stop, usage with cached tokens, session_id as an extra field."""
import pytest

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-hybrid"]


def test_completion_then_cached_repeat(client, server):
    prompt = "The quick brown fox jumps over the lazy dog, again and again."
    a = client.completions.create(model="tiny-hybrid", prompt=prompt, max_tokens=6, temperature=0)
    b = client.completions.create(model="tiny-hybrid", prompt=prompt, max_tokens=6, temperature=0)
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 6
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(prompt.encode())
    assert b.usage.prompt_tokens_details.cached_tokens >= len(prompt.encode()) - 1
    server.audit()


def test_completion_token_prompts_batch(client):
    r = client.completions.create(model="tiny-hybrid", prompt=[[10, 20, 30, 40], [50, 60, 70]], max_tokens=3,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 6


def test_completion_stream_equals_whole(client):
    kw = dict(model="tiny-hybrid", prompt="streaming, token by token", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_and_chat_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="tiny-hybrid", messages=msgs, max_tokens=5, temperature=0,
                                       extra_body={"session_id": "chat-1"})
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 5
    parts = list(client.chat.completions.create(model="tiny-hybrid", messages=msgs, max_tokens=5,
                                                temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == r.choices[0].message.content
    # the next turn of the same conversation reuses the first
    msgs2 = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "and again"}]
    r2 = client.chat.completions.create(model="tiny-hybrid", messages=msgs2, max_tokens=5, temperature=0,
                                        extra_body={"session_id": "chat-1"})
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_sequence(client):
    kw = dict(model="tiny-hybrid", prompt="abcabcabc", max_tokens=16, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = next((ch for ch in text if ch.isalnum()), None)
    if stop is None:
        pytest.skip("this seed's output has no letter or digit to stop at")
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_openai_errors_are_4xx(client):
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model="tiny-hybrid", prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny-hybrid", messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-hybrid", prompt="x", temperature=-1)


def test_default_lengths(client):
    r = client.completions.create(model="tiny-hybrid", prompt="no max_tokens given", temperature=0)
    assert r.usage.completion_tokens == 16  # OpenAI's default for completions
    c = client.chat.completions.create(model="tiny-hybrid", messages=[{"role": "user", "content": "x"}],
                                       temperature=0)
    assert c.usage.completion_tokens == 128  # a chat reply: SGLang's native default
    c = client.chat.completions.create(model="tiny-hybrid", messages=[{"role": "user", "content": "x"}],
                                       temperature=0, max_completion_tokens=3, max_tokens=9)
    assert c.usage.completion_tokens == 3  # the newer name wins
