"""A local stand-in for the Hugging Face Hub: a cache folder laid out as huggingface_hub lays it out,
and a tiny HTTP server that answers repo look-ups with the Hub's error replies.

    cache/models--org--name/refs/main             "<commit>"
                           /snapshots/<commit>/   config.json, tokenizer.json, *.safetensors, ...
"""

import http.server
import json
import shutil
import threading
from pathlib import Path


def cache_model(cache: Path, repo: str, source: Path, *, revision: str = "main", commit: str = "a" * 40) -> Path:
    """Put `source`'s files into `cache` as the snapshot of `repo` at `revision`; returns the snapshot."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    return snapshot


# repo id -> (status, X-Error-Code) the server answers for it; a revision "nope" does not exist
REPLIES = {"org/missing": (404, "RepoNotFound"), "org/gated": (403, "GatedRepo")}
# org/huge exists: a config and one 2 PB safetensors file (its download never starts: no disk has room)
HUGE = {"id": "org/huge", "sha": "c" * 40, "siblings": [
    {"rfilename": "config.json", "size": 700}, {"rfilename": "model.safetensors", "size": 2 * 10**15},
    {"rfilename": "pytorch_model.bin", "size": 4 * 10**15}]}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):   # /api/models/<org>/<name>/revision/<rev>
        parts = self.path.split("?")[0].strip("/").split("/")
        repo, rev = "/".join(parts[2:4]), parts[5] if len(parts) > 5 else "main"
        status, code = REPLIES.get(repo, (404, "RevisionNotFound") if rev == "nope" else (500, ""))
        body = b'{"error": "fake hub"}'
        if repo == "org/huge":
            status, code, body = 200, "", json.dumps(HUGE).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class FakeHub:
    def __enter__(self) -> str:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
