"""The dashboard and chat playground: one static page from package data
(``transport/ui/``), served at ``/`` and ``/ui``.

The page holds no data, so it loads without the API key (``transport.server.security``
lists these paths as public, like ``/health``); everything it shows comes from
``/stats``, ``/v1/models`` and ``/v1/chat/completions``, which it calls with the
key the user typed (kept in the tab's ``sessionStorage``). Its CSP confines it
to this origin: no script, style, image or request goes anywhere else.
``HEAD /`` answers 200 (clients probe it). docs/ui.md.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ASSETS = {
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/ui/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
PAGE = ("index.html", "text/html; charset=utf-8")
CONFIG = "/ui/config.json"  # {"api_key_required": bool}: the page asks for the key before any API call
PATHS = frozenset({"/", "/ui", CONFIG, *ASSETS})  # public: static files, no data (transport.server.security)

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


@functools.cache
def asset(name: str) -> bytes:
    """A file of the page, read once from the installed package."""
    return resources.files("transport").joinpath("ui", name).read_bytes()


def _serve(name: str, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return Response(asset(name), media_type=media_type, headers=HEADERS)

    return endpoint


async def config(request: Request) -> Response:
    """What the page must know before its first API call (a 401 already tells anyone as much)."""
    required = bool(getattr(request.app.state, "api_key_required", False))
    return JSONResponse({"api_key_required": required}, headers=HEADERS)


def routes() -> list[Route]:
    page = _serve(*PAGE)
    return [
        Route(CONFIG, config, methods=["GET"]),
        Route("/", page, methods=["GET", "HEAD"]),
        Route("/ui", page, methods=["GET", "HEAD"]),
        *(Route(path, _serve(*file), methods=["GET", "HEAD"]) for path, file in ASSETS.items()),
    ]
