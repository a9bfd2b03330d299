"""What a browser must not be able to do to a local server: one ASGI
middleware in front of every route, so routes added later are covered too.

* ``Host`` check (DNS rebinding, the class of Ollama's CVE-2024-28224): when
  the server is bound to a loopback address, only loopback names are
  accepted in ``Host`` (``127.0.0.1``, any ``127.x``, ``localhost``,
  ``[::1]``, with any port). A page on ``attacker.example`` whose name was
  rebound to 127.0.0.1 still sends ``Host: attacker.example``: 421.
* ``Content-Type: application/json`` on every POST/PUT/PATCH (415 otherwise):
  ``text/plain``, form and missing types are what a cross-origin page can
  send without a CORS preflight; JSON needs one, which this server never
  grants (it sends no CORS headers).
* ``--api-key`` / ``--api-keys`` (``transport.wire.api_keys``): every route except
  ``/health`` and the dashboard's static page (``/``, ``/ui``, ``/ui/*``: no
  data; its API calls carry the key) wants ``Authorization: Bearer <key>``
  (OpenAI clients) or ``x-api-key: <key>`` (Anthropic clients); 401
  otherwise. Compared in constant time. The key's name goes on with the
  request (``key_name``): it is the request's cache scope. With named keys the
  operator routes (``OPERATOR_PATHS``) want the admin key: 403 otherwise.

Checked in that order; rejections use the OpenAI error shape.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

from transport.server.ui_routes import PATHS as UI_PATHS
from transport.wire.api_keys import SCOPE_KEY, Keys, SingleKey
from transport.wire.errors import ApiError, error_body

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

# liveness probes carry no key; nor does the dashboard's static page (it holds no data, its API calls carry the key)
PUBLIC_PATHS = frozenset({"/health", *UI_PATHS})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# What the operator sees: every tenant's traffic (/stats' recent requests and
# their cached tokens, /metrics) and the levers (/admin/*). With named keys,
# only the admin key (transport.wire.api_keys.ADMIN) reaches them.
OPERATOR_PATHS = frozenset({"/stats", "/metrics"})
OPERATOR_PREFIX = "/admin/"


def is_operator_path(path: str) -> bool:
    return path in OPERATOR_PATHS or path.startswith(OPERATOR_PREFIX)


def is_loopback(host: str) -> bool:
    """Is ``host`` (a bind address or a name, without port) a loopback one?"""
    h = host.strip().lower().rstrip(".")
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name in a ``Host`` header value, without its port."""
    v = value.strip()
    if v.startswith("["):  # [::1]:8000
        end = v.find("]")
        return v[: end + 1] if end > 0 else v
    if v.count(":") == 1:
        return v.split(":", 1)[0]
    return v


class SecurityMiddleware:
    def __init__(
        self, app: ASGIApp, *, api_key: str | None = None, keys: Keys | None = None, loopback_only: bool = False
    ):
        if api_key and keys is not None:
            raise ValueError("give either api_key (one key) or keys (named keys), not both")
        self.app = app
        self.keys: Keys | None = SingleKey(api_key) if api_key else keys
        self.loopback_only = loopback_only

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self.check(scope)
        if err is None:
            await self.app(scope, receive, send)
            return
        await _reply(send, err)

    def check(self, scope: dict[str, Any]) -> ApiError | None:
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        if self.loopback_only:
            host = headers.get(b"host")
            if host is not None:
                name = host_name(host.decode("latin-1"))
                if not is_loopback(name):
                    return ApiError(
                        421,
                        f"Host {name!r} is not a loopback name: this server listens on loopback only and answers "
                        "Host 127.0.0.1, localhost or [::1] (protection against DNS rebinding; serve on another "
                        "--host to accept other names)",
                        param="Host",
                        code="invalid_host",
                    )
        path = scope.get("path", "")
        if self.keys is not None and path not in PUBLIC_PATHS:
            who = self._key_name(headers)
            if who is None:
                return ApiError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    param="Authorization",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
            if is_operator_path(path) and not self.keys.is_admin(who):
                return ApiError(
                    403,
                    f"{path} shows or changes every tenant's state: it needs the admin key (the key named 'admin' "
                    "in --api-keys)",
                    "permission_error",
                    param="Authorization",
                    code="admin_key_required",
                )
            scope[SCOPE_KEY] = who  # read by transport.wire.api_keys.key_name
        if scope.get("method") in BODY_METHODS:
            ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if ctype != b"application/json":
                shown = ctype.decode("latin-1") or "none"
                return ApiError(
                    415,
                    f"Content-Type must be application/json (got {shown})",
                    param="Content-Type",
                    code="unsupported_media_type",
                )
        return None

    def _key_name(self, headers: dict[bytes, bytes]) -> str | None:
        """The name of the key the request carries (Bearer first, then x-api-key), or None."""
        keys = self.keys
        assert keys is not None
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer":
            name = keys.name_of(token.strip())
            if name is not None:
                return name
        alt = headers.get(b"x-api-key")
        return keys.name_of(alt.strip()) if alt is not None else None


async def _reply(send: Any, err: ApiError) -> None:
    body = error_body(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
