"""A hub-shaped HTTP server on loopback that serves model repos from local directories.

It answers the requests `huggingface_hub.snapshot_download` (2.4.0) sends, the way huggingface.co
does, so downloads can be tested without any network beyond 127.0.0.1:

- GET  /api/models/{owner}/{name}[/revision/{rev}]   repo info: sha (the commit) and siblings
- GET  /api/models/{owner}/{name}/tree/{rev}[/{path}]?recursive=...   file listing (with lfs info)
- HEAD/GET /{owner}/{name}/resolve/{rev}/{filename}
    regular files: 200 with ETag (the git blob id), Content-Length, X-Repo-Commit;
    LFS files (*.safetensors, *.bin, *.gguf, ...): 302 to a "CDN" URL with X-Repo-Commit,
    X-Linked-Etag (the sha256), X-Linked-Size and Location (the CDN lives on another origin,
    `localhost` instead of 127.0.0.1, so huggingface_hub treats it like the real CDN: it does not
    follow the HEAD redirect and drops auth)
- GET  /cdn/{sha256}/{filename}   the LFS bytes
- GET  /api/agent-harnesses   an empty registry (huggingface_hub 2.4.0 fetches it once per process
  from the endpoint to build its user agent)
- 404s carry X-Error-Code: RepoNotFound / RevisionNotFound / EntryNotFound like the hub's.

File bodies honour `Range: bytes=N-` / `bytes=N-M` (206 + Content-Range). No xet headers are ever
sent, so huggingface_hub always takes the plain HTTP path.

Knobs: `cut_transfer(filename, after_bytes, times)` cuts the connection mid-body (after the headers
promised the full length), `fail(filename, status, times)` answers GETs of a file with an error,
and every request is recorded in `requests` (see `file_requests`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_PATTERNS = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the hub stores big files in LFS whatever their name


@dataclass(frozen=True)
class RepoFile:
    path: str
    data: bytes

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def lfs(self) -> bool:
        name = self.path.rsplit("/", 1)[-1]
        return len(self.data) >= LFS_MIN_SIZE or any(fnmatch(name, p) for p in LFS_PATTERNS)


@dataclass(frozen=True)
class Commit:
    sha: str
    files: Mapping[str, RepoFile]


@dataclass
class Repo:
    revisions: dict[str, str] = field(default_factory=dict[str, str])  # branch/tag -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict[str, Commit])


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # decoded path, without the query
    status: int
    filename: str | None = None  # the repo file a resolve/CDN request was about
    range: str | None = None


@dataclass
class _Fault:
    times: int | None  # None: every time
    after_bytes: int = 0
    status: int = 500


def read_directory(directory: Path, extra: Mapping[str, bytes] | None = None) -> dict[str, bytes]:
    files = {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
    files.update(extra or {})
    return files


class HubServer:
    """Start with `with HubServer() as hub:` (or start()/stop()); `hub.url` is the HF_ENDPOINT."""

    def __init__(self, *, cdn_host: str = "localhost") -> None:
        self.cdn_host = cdn_host
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._cuts: dict[str, _Fault] = {}
        self._failures: dict[str, _Fault] = {}
        self._connections: set[socket.socket] = set()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- repos ---------------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        directory: Path | None = None,
        *,
        revision: str = "main",
        extra_files: Mapping[str, bytes] | None = None,
    ) -> str:
        """Serve `directory` (plus `extra_files`) as `revision` of `repo_id`; returns the commit."""
        files = (
            read_directory(directory, extra_files)
            if directory is not None
            else dict(extra_files or {})
        )
        digest = hashlib.sha1(f"{repo_id}\0{revision}\0".encode())
        for path in sorted(files):
            digest.update(f"{path}\0{RepoFile(path, files[path]).git_oid}\0".encode())
        sha = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[sha] = Commit(sha, {p: RepoFile(p, d) for p, d in files.items()})
        repo.revisions[revision] = sha
        return sha

    def commit(self, repo_id: str, revision: str = "main") -> str:
        return self.repos[repo_id].revisions[revision]

    # -- knobs ---------------------------------------------------------------------------------

    def cut_transfer(self, filename: str, *, after_bytes: int, times: int | None = 1) -> None:
        """Close the connection after `after_bytes` of the body of the next `times` GETs of
        `filename` (None: every GET)."""
        with self._lock:
            self._cuts[filename] = _Fault(times=times, after_bytes=after_bytes)

    def fail(self, filename: str, *, status: int = 500, times: int | None = 1) -> None:
        """Answer the next `times` GETs of `filename` (None: every GET) with `status`."""
        with self._lock:
            self._failures[filename] = _Fault(times=times, status=status)

    def clear_faults(self) -> None:
        with self._lock:
            self._cuts.clear()
            self._failures.clear()

    def file_requests(self, filename: str, method: str | None = None) -> list[Request]:
        with self._lock:
            return [
                r
                for r in self.requests
                if r.filename == filename and (method is None or r.method == method)
            ]

    def requested_files(self) -> set[str]:
        with self._lock:
            return {r.filename for r in self.requests if r.filename is not None}

    def _take(self, faults: dict[str, _Fault], filename: str) -> _Fault | None:
        with self._lock:
            fault = faults.get(filename)
            if fault is None:
                return None
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    del faults[filename]
            return fault

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        hub = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def process_request(self, request: Any, client_address: Any) -> None:
                with hub._lock:
                    hub._connections.add(request)
                super().process_request(request, client_address)

            def shutdown_request(self, request: Any) -> None:
                with hub._lock:
                    hub._connections.discard(request)
                super().shutdown_request(request)

        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = Server(("127.0.0.1", 0), handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop every open (keep-alive) connection: afterwards nothing answers."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    # -- responses -----------------------------------------------------------------------------

    def _record(self, status: int, filename: str | None = None) -> None:
        path = unquote(urlsplit(self.path).path)
        request = Request(self.command, path, status, filename, self.headers.get("Range"))
        with self.hub._lock:
            self.hub.requests.append(request)

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        *,
        head: bool = False,
        filename: str | None = None,
    ) -> None:
        self._record(status, filename)
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, data: object, *, head: bool) -> None:
        body = json.dumps(data).encode()
        self._send(200, body, {"Content-Type": "application/json"}, head=head)

    def _error(
        self,
        code: str | None,
        message: str,
        *,
        head: bool,
        status: int = 404,
        extra: Mapping[str, str] | None = None,
        filename: str | None = None,
    ) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code is not None:
            headers["X-Error-Code"] = code
        headers.update(extra or {})
        body = json.dumps({"error": message}).encode()
        self._send(status, body, headers, head=head, filename=filename)

    # -- routing -------------------------------------------------------------------------------

    def _route(self, *, head: bool) -> None:
        split = urlsplit(self.path)
        # Split the raw path first: a revision such as refs/pr/1 arrives as one %2F-quoted segment.
        parts = [unquote(p) for p in split.path.split("/")[1:]]
        query = parse_qs(split.query)
        if parts == ["api", "agent-harnesses"]:  # huggingface_hub asks once per process
            return self._json({"standardEnvVars": [], "harnesses": {}}, head=head)
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo_id = f"{parts[2]}/{parts[3]}"
            rest = parts[4:]
            if not rest:
                return self._info(repo_id, "main", head=head)
            if rest[0] == "revision" and len(rest) == 2:
                return self._info(repo_id, rest[1], head=head)
            if rest[0] == "tree" and len(rest) >= 2:
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                return self._tree(repo_id, rest[1], "/".join(rest[2:]), recursive, head=head)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head=head)
        if len(parts) >= 3 and parts[0] == "cdn":
            return self._cdn(parts[1], "/".join(parts[2:]), head=head)
        self._error(None, "Not Found", head=head)

    def _commit(self, repo_id: str, revision: str, *, head: bool) -> Commit | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error("RepoNotFound", "Repository not found", head=head, status=404)
            return None
        sha = repo.revisions.get(revision, revision)
        commit = repo.commits.get(sha)
        if commit is None:
            self._error("RevisionNotFound", f"Invalid rev id: {revision}", head=head)
        return commit

    def _info(self, repo_id: str, revision: str, *, head: bool) -> None:
        commit = self._commit(repo_id, revision, head=head)
        if commit is None:
            return
        self._json(
            {
                "_id": commit.sha[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit.sha,
                "lastModified": "2025-01-01T00:00:00.000Z",
                "createdAt": "2025-01-01T00:00:00.000Z",
                "private": False,
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "library_name": "transformers",
                "siblings": [{"rfilename": p} for p in sorted(commit.files)],
            },
            head=head,
        )

    def _tree(
        self, repo_id: str, revision: str, under: str, recursive: bool, *, head: bool
    ) -> None:
        commit = self._commit(repo_id, revision, head=head)
        if commit is None:
            return
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for path in sorted(commit.files):
            if not path.startswith(prefix):
                continue
            rel = path[len(prefix) :].split("/")
            for depth in range(1, len(rel)):
                folder = prefix + "/".join(rel[:depth])
                if folder not in folders and (recursive or depth == 1):
                    folders.add(folder)
                    oid = hashlib.sha1(folder.encode()).hexdigest()
                    entries.append({"type": "directory", "oid": oid, "size": 0, "path": folder})
            if not recursive and len(rel) > 1:
                continue
            f = commit.files[path]
            entry: dict[str, object] = {
                "type": "file",
                "oid": f.git_oid,
                "size": len(f.data),
                "path": path,
            }
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
            entries.append(entry)
        if prefix and not entries:
            self._error("EntryNotFound", f"{under} does not exist", head=head)
            return
        self._json(entries, head=head)

    def _resolve(self, repo_id: str, revision: str, filename: str, *, head: bool) -> None:
        commit = self._commit(repo_id, revision, head=head)
        if commit is None:
            return
        f = commit.files.get(filename)
        if f is None:
            self._error(
                "EntryNotFound",
                "Entry not found",
                head=head,
                extra={"X-Repo-Commit": commit.sha},
                filename=filename,
            )
            return
        headers = {"X-Repo-Commit": commit.sha, "Accept-Ranges": "bytes"}
        if f.lfs:
            location = f"http://{self.hub.cdn_host}:{self.hub.port}/cdn/{f.sha256}/{quote(f.path)}"
            headers.update(
                {
                    "Location": location,
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(len(f.data)),
                    "ETag": f'"{f.git_oid}"',
                }
            )
            self._send(302, b"", headers, head=head, filename=filename)
            return
        headers["ETag"] = f'"{f.git_oid}"'
        self._body(f, headers, head=head)

    def _cdn(self, sha256: str, filename: str, *, head: bool) -> None:
        for repo in self.hub.repos.values():
            for commit in repo.commits.values():
                f = commit.files.get(filename)
                if f is not None and f.sha256 == sha256:
                    self._body(f, {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes"}, head=head)
                    return
        self._error(None, "NoSuchKey", head=head, filename=filename)

    def _body(self, f: RepoFile, headers: dict[str, str], *, head: bool) -> None:
        if not head and (failure := self.hub._take(self.hub._failures, f.path)) is not None:
            self._error(None, "Internal Error", head=head, status=failure.status, filename=f.path)
            return
        data = f.data
        status = 200
        range_header = self.headers.get("Range")
        if range_header is not None:
            bounds = _parse_range(range_header, len(data))
            if bounds is None:
                headers["Content-Range"] = f"bytes */{len(data)}"
                self._send(416, b"", headers, head=head, filename=f.path)
                return
            start, end = bounds
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data = data[start : end + 1]
            status = 206
        cut = None if head else self.hub._take(self.hub._cuts, f.path)
        if cut is None:
            self._send(status, data, headers, head=head, filename=f.path)
            return
        # Promise the whole body, send part of it, then drop the connection.
        self._record(status, f.path)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: cut.after_bytes])
        self.wfile.flush()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":  # suffix: the last N bytes
            n = int(last)
            return (max(size - n, 0), size - 1) if n > 0 and size else None
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)


def iter_snapshot_files(snapshot: Path) -> Iterator[str]:
    for p in sorted(snapshot.rglob("*")):
        if p.is_file():
            yield p.relative_to(snapshot).as_posix()
