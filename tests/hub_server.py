"""A local stand-in for the Hugging Face Hub, enough of its HTTP API for huggingface_hub's downloads.

    hub = FakeHub(); hub.add("org/tiny", {"config.json": b"...", "model.safetensors": b"..."})
    with hub.serving() as url:     # point HF_ENDPOINT (or huggingface_hub.constants.ENDPOINT) at url
        ...

What huggingface_hub calls (read from its source, 2.x): ``snapshot_download``:
``GET /api/models/{repo}/revision/{rev}`` (the commit) and
``GET /api/models/{repo}/tree/{commit}?recursive=true`` (the file list); then
per file ``hf_hub_download``: ``HEAD /{repo}/resolve/{commit}/{file}`` for the
``X-Repo-Commit``, ``ETag``/``X-Linked-Etag`` (LFS: the sha256) and size, and
``GET`` of the same URL, with ``Range: bytes=N-`` when it resumes. Errors carry
``X-Error-Code`` (RepoNotFound, GatedRepo) as the hub's do.

Faults, per (repo, file): ``cut_once`` sends 3/4 of the body then closes the
connection, once; ``corrupt`` serves other bytes than the hashes advertised;
``hold`` (a threading.Event) stalls a body 3/4 of the way until set. Every request is
recorded in ``requests`` as (method, path).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.gated: set[str] = set()  # repos that answer 401 GatedRepo without `token`
        self.token = "hf_fake_token"
        self.cut_once: set[tuple[str, str]] = set()
        self.corrupt: dict[tuple[str, str], bytes] = {}
        self.hold: dict[tuple[str, str], threading.Event] = {}
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of resumed GETs
        self.lock = threading.Lock()

    def add(self, repo: str, files: dict[str, bytes]) -> str:
        self.repos[repo] = dict(files)
        self.commits[repo] = hashlib.sha1(
            repo.encode() + b"".join(git_sha1(files[f]).encode() for f in sorted(files))
        ).hexdigest()
        return self.commits[repo]

    def downloads(self) -> list[str]:
        """The paths of file GETs so far."""
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]

    @contextlib.contextmanager
    def serving(self) -> Iterator[str]:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self, head=False)

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            for ev in self.hold.values():
                ev.set()
            server.shutdown()
            server.server_close()

    # ---- the API -----------------------------------------------------------
    def handle(self, h: http.server.BaseHTTPRequestHandler, head: bool) -> None:
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        with self.lock:
            self.requests.append(("HEAD" if head else "GET", path))
            if h.headers.get("Range"):
                self.ranges.append((path, h.headers["Range"]))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
            if not self._repo_ok(h, repo, rev):
                return
            if kind == "revision":
                files = self.repos[repo]
                body = {"id": repo, "sha": self.commits[repo], "siblings": [{"rfilename": f} for f in files]}
                return self._json(h, body)
            if kind == "tree":
                return self._json(h, [self._entry(repo, f) for f in sorted(self.repos[repo])])
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if not self._repo_ok(h, repo, rev):
                return
            if file not in self.repos[repo]:
                return self._error(h, 404, "EntryNotFound")
            return self._file(h, repo, file, head)
        self._error(h, 404, "RepoNotFound")

    def _repo_ok(self, h: http.server.BaseHTTPRequestHandler, repo: str, rev: str) -> bool:
        if repo in self.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 401, "GatedRepo")
            return False
        if repo not in self.repos:
            self._error(h, 404, "RepoNotFound")
            return False
        if rev not in ("main", self.commits[repo]):
            self._error(h, 404, "RevisionNotFound")
            return False
        return True

    def _entry(self, repo: str, file: str) -> dict[str, object]:
        data = self.repos[repo][file]
        entry: dict[str, object] = {"type": "file", "path": file, "size": len(data), "oid": git_sha1(data)}
        if file.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _json(self, h: http.server.BaseHTTPRequestHandler, body: object) -> None:
        data = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _error(self, h: http.server.BaseHTTPRequestHandler, status: int, code: str) -> None:
        data = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _file(self, h: http.server.BaseHTTPRequestHandler, repo: str, file: str, head: bool) -> None:
        true = self.repos[repo][file]
        data = self.corrupt.get((repo, file), true)
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[len("bytes=") :].split("-")[0])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", self.commits[repo])
        h.send_header("Accept-Ranges", "bytes")
        if file.endswith(LFS_SUFFIXES):
            h.send_header("ETag", f'"{git_sha1(true)}"')
            h.send_header("X-Linked-Etag", f'"{hashlib.sha256(true).hexdigest()}"')
            h.send_header("X-Linked-Size", str(len(true)))
        else:
            h.send_header("ETag", f'"{git_sha1(true)}"')
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Length", str(len(data) - start))
        h.end_headers()
        if head:
            return
        body = data[start:]
        cut_at = len(body) * 3 // 4
        key = (repo, file)
        with self.lock:
            cut = key in self.cut_once and not start
            self.cut_once.discard(key) if cut else None
        if cut:  # the connection drops mid-file, once: past huggingface_hub's first 10 MiB read chunk
            h.wfile.write(body[:cut_at])
            h.wfile.flush()
            h.close_connection = True
            with contextlib.suppress(OSError):
                h.connection.shutdown(2)
            return
        hold = self.hold.get(key)
        if hold is not None:  # stalls past huggingface_hub's first 10 MiB read chunk, so progress shows
            h.wfile.write(body[:cut_at])
            h.wfile.flush()
            hold.wait(30)
            h.wfile.write(body[cut_at:])
            return
        h.wfile.write(body)
