"""A small Hugging Face Hub on loopback, for tests and `make demo` (no network): the HTTP endpoints huggingface_hub's
clients use to create a repository, push a folder (regular files inline, large ones through the basic LFS protocol)
and download it (repo info, tree listing, resolve). Clients point at it with HF_ENDPOINT and need
HF_HUB_DISABLE_XET=1.

Repositories live in memory as a chain of commits, each a full {path: sha256} tree; blobs are stored by sha256.
Tokens map to users, and a user may write to their own namespace and their organisations' only (401 without a
token, 403 elsewhere). Every request is logged in `requests`, so a test can assert that none was made.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".png", ".parquet")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file, which the Hub reports for regular (non-LFS) files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    parent: str | None
    message: str
    tree: dict[str, str]                   # path -> sha256 of the content


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)
    branches: dict[str, str] = field(default_factory=dict)       # branch -> commit sha

    def commit_at(self, revision: str) -> Commit | None:
        sha = self.branches.get(revision, revision)
        return next((c for c in self.commits if c.sha == sha), None)


class LoopbackHub:
    """The Hub's state; `serve()` starts it on 127.0.0.1 in a daemon thread (stop with `close()`)."""

    def __init__(self, users: dict[str, tuple[str, list[str]]]):
        self.users = users                           # token -> (user name, organisations)
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}            # sha256 -> content
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    # ---- state -------------------------------------------------------------------------------------------------
    def create(self, repo_id: str, private: bool = False) -> Repo:
        repo = Repo(repo_id, private)
        self.repos[repo_id] = repo
        attrs = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"     # what the Hub's first commit holds
        self.commit(repo, "main", "initial commit", {".gitattributes": attrs}, [])
        return repo

    def commit(self, repo: Repo, branch: str, message: str, files: dict[str, bytes], deleted: list[str],
               lfs: dict[str, str] | None = None) -> Commit:
        head = repo.commit_at(branch)
        tree = dict(head.tree) if head else {}
        for path, data in files.items():
            digest = hashlib.sha256(data).hexdigest()
            self.blobs[digest] = data
            tree[path] = digest
        tree.update(lfs or {})
        for path in deleted:
            tree.pop(path, None)
        sha = hashlib.sha1(json.dumps([head.sha if head else None, message, sorted(tree.items())]).encode()
                           + str(len(repo.commits)).encode()).hexdigest()
        c = Commit(sha, head.sha if head else None, message, tree)
        repo.commits.append(c)
        repo.branches[branch] = sha
        return c

    def can_write(self, token: str | None, repo_id: str) -> int:
        """200, 401 (no or unknown token) or 403 (not the user's namespace)."""
        if token not in self.users:
            return 401
        user, orgs = self.users[token]
        return 200 if repo_id.split("/")[0] in [user, *orgs] else 403

    # ---- server ------------------------------------------------------------------------------------------------
    def serve(self) -> str:
        hub = self

        class Handler(_Handler):
            pass
        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


REPO = r"(?P<repo>[^/]+/[^/]+)"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: LoopbackHub

    def log_message(self, fmt, *args):            # quiet
        pass

    # ---- plumbing ----------------------------------------------------------------------------------------------
    def _reply(self, code: int, body=b"", headers: dict | None = None) -> None:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, code: int, message: str, error_code: str | None = None) -> None:
        self._reply(code, {"error": message}, {"X-Error-Code": error_code} if error_code else None)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    def _readable(self, repo_id: str) -> Repo | None:
        """The repository, or None after a 404 reply (missing, or private and not the caller's)."""
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and self.hub.can_write(self._token(), repo_id) != 200):
            self._error(404, f"Repository {repo_id} not found", "RepoNotFound")
            return None
        return repo

    def _writable(self, repo_id: str) -> Repo | None:
        code = self.hub.can_write(self._token(), repo_id)
        if code != 200:
            self._error(code, "Invalid credentials" if code == 401 else f"You don't have write access to {repo_id}")
            return None
        return self._readable(repo_id)

    def _route(self, method: str):
        path = urllib.parse.urlparse(self.path).path
        self.hub.requests.append((method, path))
        self.body = self._body() if method in ("POST", "PUT") else b""      # always read: the connection is reused
        for pattern, name in ROUTES[method]:
            m = re.fullmatch(pattern, path)
            if m:
                with self.hub.lock:
                    return getattr(self, name)(**{k: urllib.parse.unquote(v) for k, v in m.groupdict().items()
                                                  if v is not None})
        self._error(404, f"no route for {method} {path}")

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")

    # ---- endpoints ---------------------------------------------------------------------------------------------
    def whoami(self):
        token = self._token()
        if token not in self.hub.users:
            return self._error(401, "Invalid credentials")
        user, orgs = self.hub.users[token]
        self._reply(200, {"type": "user", "name": user, "orgs": [{"name": o} for o in orgs],
                          "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def create_repo(self):
        d = json.loads(self.body)
        repo_id = f"{d['organization']}/{d['name']}" if d.get("organization") else d["name"]
        code = self.hub.can_write(self._token(), repo_id)
        if code != 200:
            return self._error(code, "Invalid credentials" if code == 401 else
                               f"You don't have the rights to create a model under the namespace "
                               f"{repo_id.split('/')[0]}")
        if repo_id in self.hub.repos:                     # the Hub's 409 names the existing repository's url
            return self._reply(409, {"error": "You already created this model repo",
                                     "url": f"{self._base()}/{repo_id}"})
        self.hub.create(repo_id, private=d.get("private") or d.get("visibility") == "private")
        self._reply(200, {"url": f"{self._base()}/{repo_id}", "name": repo_id, "id": repo_id})

    def create_branch(self, repo, branch):
        r = self._writable(repo)
        if r is None:
            return
        if branch in r.branches:
            return self._error(409, f"Reference {branch} already exists")
        r.branches[branch] = r.branches["main"]
        self._reply(200, {})

    def repo_info(self, repo, revision="main"):
        r = self._readable(repo)
        if r is None:
            return
        c = r.commit_at(revision)
        if c is None:
            return self._error(404, f"Revision {revision} not found", "RevisionNotFound")
        self._reply(200, {"id": repo, "modelId": repo, "sha": c.sha, "private": r.private,
                          "siblings": [{"rfilename": p} for p in sorted(c.tree)]})

    def tree(self, repo, revision, path=""):
        r = self._readable(repo)
        if r is None:
            return
        c = r.commit_at(revision)
        if c is None:
            return self._error(404, f"Revision {revision} not found", "RevisionNotFound")
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        recursive = "recursive=true" in self.path.lower()
        entries, dirs = [], set()
        for p in sorted(c.tree):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            if "/" in rest:
                parts = rest.split("/")
                for i in range(1, len(parts) if recursive else 2):
                    dirs.add(prefix + "/".join(parts[:i]))
                if not recursive:
                    continue
            entries.append(self._entry(p, c.tree[p]))
        entries += [{"type": "directory", "path": d, "oid": "0" * 40, "size": 0} for d in sorted(dirs)]
        if prefix and not entries:
            return self._error(404, f"{path} not found", "EntryNotFound")
        self._reply(200, entries)

    def paths_info(self, repo, revision):
        r = self._readable(repo)
        if r is None:
            return
        body = self.body
        want = json.loads(body).get("paths", []) if body.startswith(b"{") else \
            urllib.parse.parse_qs(body.decode()).get("paths", [])
        c = r.commit_at(revision)
        self._reply(200, [self._entry(p, c.tree[p]) for p in want if c and p in c.tree])

    def _entry(self, path: str, digest: str) -> dict:
        data = self.hub.blobs[digest]
        e = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
        if path.endswith(LFS_SUFFIXES):
            e["lfs"] = {"oid": digest, "size": len(data), "pointerSize": 134}
        return e

    def preupload(self, repo, revision):
        r = self._writable(repo)
        if r is None:
            return
        c = r.commit_at(revision)
        out = []
        for f in json.loads(self.body)["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES)
            item = {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            if c and f["path"] in c.tree:                  # what the client compares to skip unchanged files
                digest = c.tree[f["path"]]
                item["oid"] = digest if lfs else git_blob_sha1(self.hub.blobs[digest])
            out.append(item)
        self._reply(200, {"files": out, "commitOid": c.sha if c else None})

    def lfs_batch(self, repo):
        if self._writable(repo) is None:
            return
        objects = []
        for o in json.loads(self.body)["objects"]:
            obj = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.hub.blobs:
                obj["actions"] = {"upload": {"href": f"{self._base()}/lfs-upload/{o['oid']}", "header": {}}}
            objects.append(obj)
        self._reply(200, {"transfer": "basic", "objects": objects})

    def lfs_upload(self, oid):
        data = self.body
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, "sha256 of the upload does not match its oid")
        self.hub.blobs[oid] = data
        self._reply(200, b"")

    def commit(self, repo, revision):
        r = self._writable(repo)
        if r is None:
            return
        if r.commit_at(revision) is None:
            return self._error(404, f"Revision {revision} not found", "RevisionNotFound")
        message, files, lfs, deleted = "", {}, {}, []
        for line in self.body.decode().splitlines():
            if not line.strip():
                continue
            op = json.loads(line)
            key, value = op["key"], op["value"]
            if key == "header":
                message = value.get("summary", "")
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self.hub.blobs:
                    return self._error(422, f"LFS object {value['oid']} was never uploaded")
                lfs[value["path"]] = value["oid"]
            elif key == "deletedFile":
                deleted.append(value["path"])
        c = self.hub.commit(r, revision, message, files, deleted, lfs)
        self._reply(200, {"commitUrl": f"{self._base()}/{repo}/commit/{c.sha}", "commitOid": c.sha,
                          "success": True})

    def resolve(self, repo, revision, path):
        r = self._readable(repo)
        if r is None:
            return
        c = r.commit_at(revision)
        if c is None:
            return self._error(404, f"Revision {revision} not found", "RevisionNotFound")
        if path not in c.tree:
            return self._error(404, f"{path} not found", "EntryNotFound")
        data = self.hub.blobs[c.tree[path]]
        etag = c.tree[path] if path.endswith(LFS_SUFFIXES) else git_blob_sha1(data)
        self._reply(200, data, {"ETag": f'"{etag}"', "X-Repo-Commit": c.sha,
                                "Content-Type": "application/octet-stream"})

    def validate_yaml(self):
        self._reply(200, {"errors": [], "warnings": []})

    def _base(self) -> str:
        return f"http://{self.headers['Host']}"


ROUTES = {
    "GET": [(r"/api/whoami-v2", "whoami"),
            (rf"/api/models/{REPO}(?:/revision/(?P<revision>[^/]+))?", "repo_info"),
            (rf"/api/models/{REPO}/tree/(?P<revision>[^/]+)(?:/(?P<path>.*))?", "tree"),
            (rf"/{REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve")],
    "POST": [(r"/api/repos/create", "create_repo"),
             (r"/api/validate-yaml", "validate_yaml"),
             (rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)", "create_branch"),
             (rf"/api/models/{REPO}/paths-info/(?P<revision>[^/]+)", "paths_info"),
             (rf"/api/models/{REPO}/preupload/(?P<revision>[^/]+)", "preupload"),
             (rf"/api/models/{REPO}/commit/(?P<revision>[^/]+)", "commit"),
             (rf"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", "lfs_batch")],
    "PUT": [(r"/lfs-upload/(?P<oid>[0-9a-f]{64})", "lfs_upload")],
}
