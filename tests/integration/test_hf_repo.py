"""`cobali serve --hf-repo` against a fake Hugging Face hub on loopback: no internet. The hub serves the embedded
model under the hub's URL layout, as much of it as huggingface_hub's list_repo_files and hf_hub_download ask for
(the tree listing, and a file's HEAD and GET with its ETag and commit). The model is fetched into HF_HOME, served,
and served again with HF_HUB_OFFLINE=1 and the hub gone; a quant the repository lacks is named in the error."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

pytest.importorskip("huggingface_hub")

from tests.integration.test_server_openai import running_server

COBALI = str(Path(sys.executable).with_name("cobali"))
REPO = "test/smol"
COMMIT = "a" * 40
# The embedded model's bytes under both names: only the picked one is ever fetched.
FILES = ("README.md", "smol-135m.Q4_1.gguf", "smol-135m.Q8_0.gguf")


class FakeHub(ThreadingHTTPServer):
    def __init__(self, model_path: str) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.blobs = {name: (Path(model_path) if name.endswith(".gguf") else None) for name in FILES}
        self.hits: Counter[str] = Counter()  # "METHOD path" -> requests
        self.etag = hashlib.sha256(Path(model_path).read_bytes()).hexdigest()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def size(self, name: str) -> int:
        blob = self.blobs[name]
        return blob.stat().st_size if blob else 5


class HubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        self.server.hits[f"{self.command} {path}"] += 1
        tree, resolve = f"/api/models/{REPO}/tree/main", f"/{REPO}/resolve/main/"
        if path == tree:
            listing = [{"type": "file", "oid": f"{i:040x}", "size": self.server.size(name), "path": name}
                       for i, name in enumerate(FILES)]
            return self._send(json.dumps(listing).encode(), {"Content-Type": "application/json"}, body)
        if path.startswith(resolve) and (name := path[len(resolve):]) in self.server.blobs:
            blob = self.server.blobs[name]
            data = blob.read_bytes() if blob and body else b"hello" if not blob else b""
            headers = {"ETag": f'"{self.server.etag}"', "X-Repo-Commit": COMMIT,
                       "Content-Length": str(self.server.size(name))}
            return self._send(data, headers, body, length_set=True)
        self._send(b'{"error": "not found"}', {"Content-Type": "application/json"}, body, status=404)

    def _send(self, data: bytes, headers: dict[str, str], body: bool, status: int = 200,
              length_set: bool = False) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if not length_set:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture
def hub(model_path: str) -> Iterator[FakeHub]:
    server = FakeHub(model_path)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def hub_env(hub_url: str, home: Path, offline: bool = False) -> dict[str, str]:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_TOKEN", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


@contextmanager
def serving(env: dict[str, str], *flags: str) -> Iterator[str]:
    with running_server("--max-slots", "2", *flags, env=env) as (base, _proc):
        yield base


def complete(base: str) -> dict:
    reply = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_hf_repo_downloads_caches_serves_and_serves_again_offline(hub: FakeHub, tmp_path: Path) -> None:
    with serving(hub_env(hub.url, tmp_path), "--hf-repo", f"{REPO}:q4_1") as base:
        answer = complete(base)
        assert answer["model"] == "smol-135m.Q4_1" and answer["choices"][0]["text"]
    cached = list((tmp_path / "hub" / "models--test--smol" / "snapshots" / COMMIT).iterdir())
    assert [p.name for p in cached] == ["smol-135m.Q4_1.gguf"]  # the picked quant only, where the hub caches
    assert hub.hits[f"GET /{REPO}/resolve/main/smol-135m.Q4_1.gguf"] == 1
    assert not any("Q8_0" in hit for hit in hub.hits)
    hub.shutdown()
    hub.server_close()
    with serving(hub_env(hub.url, tmp_path, offline=True), "--hf-repo", f"{REPO}:Q4_1") as base:
        assert complete(base)["choices"][0]["text"] == answer["choices"][0]["text"]


def test_a_quant_the_repository_lacks_is_named_with_those_it_has(hub: FakeHub, tmp_path: Path) -> None:
    done = subprocess.run([COBALI, "serve", "--hf-repo", f"{REPO}:Q5_K_M"], env=hub_env(hub.url, tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no Q5_K_M GGUF in test/smol: it has Q4_1, Q8_0" in done.stderr, done.stderr
    assert not any("resolve" in hit for hit in hub.hits)  # nothing fetched
