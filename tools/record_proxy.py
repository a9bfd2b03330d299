"""A recording proxy: forwards every request to an upstream server and saves each request body.

    python -m tools.record_proxy --upstream http://127.0.0.1:8000 --out DIR [--port 8100] [--shim]

Point a client at ``http://127.0.0.1:PORT``; each POST body is written to
``DIR/NNN.json`` as ``{"method", "path", "headers", "body", "status"}`` (the
body exactly as the client sent it, parsed). Responses (SSE included) are
passed back whole once the upstream has answered. Used to capture the Claude
Code session that tests/clients/test_session_replay.py replays
(tests/clients/fixtures/).

``--shim`` rewrites the *forwarded* copy (never the recorded one) so that a
server that still refuses parts of the client's envelope answers anyway:
mid-conversation ``system`` messages become user reminders, ``thinking``,
``context_management`` and ``output_config`` are dropped, and tool schemas lose
``propertyNames``. It exists only to record a session before the server
accepts it; a replay sends the recorded bodies unchanged.
"""

from __future__ import annotations

import argparse
import http.server
import json
import pathlib
import threading
import urllib.error
import urllib.request
from typing import Any

_HOP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


def _strip(schema: Any, key: str) -> Any:
    if isinstance(schema, dict):
        return {k: _strip(v, key) for k, v in schema.items() if k != key}
    if isinstance(schema, list):
        return [_strip(v, key) for v in schema]
    return schema


def shim(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("thinking", "context_management", "output_config")}
    msgs = []
    for m in body.get("messages", []):
        if m.get("role") == "system":
            text = m["content"] if isinstance(m["content"], str) else "".join(b.get("text", "") for b in m["content"])
            m = {"role": "user", "content": [{"type": "text", "text": f"<system-reminder>{text}</system-reminder>"}]}
        msgs.append(m)
    if msgs:
        out["messages"] = msgs
    if "tools" in out:
        out["tools"] = _strip(out["tools"], "propertyNames")
    return out


def make_handler(upstream: str, out: pathlib.Path, use_shim: bool) -> type[http.server.BaseHTTPRequestHandler]:
    lock = threading.Lock()
    counter = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def _forward(self, method: str) -> None:
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            data = raw
            parsed: Any = None
            if raw and "json" in (self.headers.get("content-type") or ""):
                parsed = json.loads(raw)
                if use_shim and isinstance(parsed, dict) and self.path.startswith("/v1/messages"):
                    data = json.dumps(shim(parsed)).encode()
            req = urllib.request.Request(upstream + self.path, data=data or None, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=900) as r:
                    status, rheaders, payload = r.status, r.headers, r.read()
            except urllib.error.HTTPError as e:
                status, rheaders, payload = e.code, e.headers, e.read()
            if method == "POST":
                with lock:
                    counter[0] += 1
                    name = out / f"{counter[0]:03d}.json"
                record = {"method": method, "path": self.path, "headers": headers, "body": parsed, "status": status}
                name.write_text(json.dumps(record, ensure_ascii=False))
            self.send_response(status)
            for k, v in rheaders.items():
                if k.lower() not in _HOP and k.lower() != "content-encoding":
                    self.send_header(k, v)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(payload)

        def do_POST(self) -> None:
            self._forward("POST")

        def do_GET(self) -> None:
            self._forward("GET")

        def do_HEAD(self) -> None:
            self._forward("HEAD")

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--shim", action="store_true", help="rewrite the forwarded copy (see the module docstring)")
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(a.upstream.rstrip("/"), out, a.shim))
    print(f"record_proxy: http://127.0.0.1:{server.server_address[1]} -> {a.upstream}, bodies in {out}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
