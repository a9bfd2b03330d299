"""The thinnest streaming server around the bare loop: a reference for bench.serve.vs_mlx_lm.

    python -m bench.serve.bare_server --model DIR --port 8123

``POST /v1/completions`` with ``stream: true`` runs ``mlx_lm.stream_generate``
on a worker thread (one request at a time) and streams each token as an
OpenAI-style SSE event, then a usage chunk and ``[DONE]``. Nothing else: no
batching, no cache, no scheduler. bench.serve.vs_mlx_lm measures it with the same client
as the two real servers, so "Ember / bare loop behind HTTP" is what Ember's
engine costs over the bare loop, with the HTTP hop and the client process on
the same cores counted on both sides (the in-process bare loop pays neither).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

_encode = msgspec.json.Encoder().encode


def build_app(model_dir: str) -> Starlette:
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_dir)
    one_at_a_time = asyncio.Lock()

    async def completions(request: Request) -> Any:
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"error": "only stream: true"}, status_code=400)
        prompt, max_tokens = body["prompt"], int(body.get("max_tokens", 16))

        async def events() -> AsyncIterator[bytes]:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Any] = asyncio.Queue()

            def work() -> None:
                last = None
                try:
                    for last in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
                        loop.call_soon_threadsafe(queue.put_nowait, last.text)
                finally:
                    loop.call_soon_threadsafe(queue.put_nowait, last)

            async with one_at_a_time:
                threading.Thread(target=work, daemon=True).start()
                while True:
                    item = await queue.get()
                    if not isinstance(item, str):
                        break
                    yield (
                        b"data: "
                        + _encode({"object": "text_completion", "choices": [{"index": 0, "text": item}]})
                        + b"\n\n"
                    )
            usage = {"prompt_tokens": item.prompt_tokens, "completion_tokens": item.generation_tokens} if item else {}
            yield b"data: " + _encode({"object": "text_completion", "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m bench.serve.bare_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    uvicorn.run(build_app(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
