"""CPU work a request asks for, done off the event loop: parsing its body, tokenizing,
detokenizing, rendering a chat template, building and serializing a large answer. The
loop only moves bytes and waits, so /health, a gateway's load polls and a one-token
/generate are answered while a 7 MB /tokenize is being encoded.

One mechanism for all of it, the one /generate's parsing and tokenizing already used:
`asyncio.to_thread`, on the event loop's default executor. Python bounds that pool
(min(32, CPUs + 4) threads), so a flood of large requests queues there instead of
starting threads without end, and the connection limits bound the flood. Not the
scheduler thread (`runner.run`): what runs there delays every running request's next
step, so it only reads the engine's state; the answer built from it is rendered here."""
from __future__ import annotations

import asyncio
import json

from starlette.responses import Response


async def off_loop(fn, /, *args, **kwargs):
    """fn(*args, **kwargs) on a worker thread; its exceptions (a BadRequest) come back here."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def render_json(content) -> bytes:
    """JSON as Starlette's JSONResponse writes it: compact, UTF-8, and no NaN or
    Infinity (not JSON: a fault of the server's, never sent)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


async def json_off_loop(build, /, *args, status_code: int = 200) -> Response:
    """The JSON answer build(*args) makes, built and serialized off the loop."""
    body = await off_loop(lambda: render_json(build(*args)))
    return Response(body, status_code=status_code, media_type="application/json")


async def json_answer(content, status_code: int = 200) -> Response:
    """A JSON answer of `content` (already built), serialized off the loop."""
    return await json_off_loop(lambda: content, status_code=status_code)
