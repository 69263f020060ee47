"""vLLM's own HF3FS metadata server and client (the peer), fetched at test time.

Nothing of vLLM is committed: `peer_source()` downloads the vLLM 0.33.0 wheel with pip into
`<repo>/target/peers/` (git-ignored; skipped when the wheel is already there) and extracts the one
standalone file `hf3fs_metadata_server.py`, which holds both the FastAPI server and
`Hf3fsGlobalMetadataClient`. It imports only orjson, requests, fastapi, uvicorn (and urllib3);
`ensure_peer_deps()` pip-installs the missing ones. `PeerServer` runs the file as vLLM does
(`python3 hf3fs_metadata_server.py --host 127.0.0.1 --port P`).

Every failure here raises `PeerError` with a message saying what to do; the tests turn it into a
test failure (never a skip: a parity suite that silently skips proves nothing).
"""

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO_ROOT / "target" / "peers"
VLLM_VERSION = "0.33.0"
MEMBER = "vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_metadata_server.py"
SCRIPT = PEERS_DIR / f"vllm-{VLLM_VERSION}" / "hf3fs_metadata_server.py"
PEER_DEPS = ("fastapi", "uvicorn", "orjson")  # requests and urllib3 come with the suite
START_WAIT_S = 30.0
STOP_WAIT_S = 5.0


class PeerError(RuntimeError):
    pass


def _wheel() -> Path | None:
    found = sorted(PEERS_DIR.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return found[0] if found else None


def peer_source(say=print) -> Path:
    """Path of vLLM 0.33.0's `hf3fs_metadata_server.py`, downloading and extracting it if needed.

    `KVPAGES_PEER_SCRIPT=/path/to/hf3fs_metadata_server.py` uses that file instead (another vLLM
    version, or a modified copy to check that the parity tests notice a difference).
    """
    override = os.environ.get("KVPAGES_PEER_SCRIPT")
    if override:
        path = Path(override)
        if not path.is_file():
            raise PeerError(f"KVPAGES_PEER_SCRIPT={override} is not a file")
        say(f"peer: using {path} (KVPAGES_PEER_SCRIPT)")
        return path
    if SCRIPT.is_file():
        return SCRIPT
    wheel = _wheel()
    if wheel is None:
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(PEERS_DIR),
               f"vllm=={VLLM_VERSION}"]
        say(f"peer: downloading the vllm=={VLLM_VERSION} wheel (~336 MB) into {PEERS_DIR} ...")
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheel = _wheel()
        if proc.returncode != 0 or wheel is None:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise PeerError(
                f"could not download vLLM {VLLM_VERSION} (the peer server the parity tests run "
                f"against): `{' '.join(cmd)}` exited with {proc.returncode}.\n{tail}\n"
                "Fix the network/pip index access, or put the wheel into that directory by hand."
            )
        say(f"peer: downloaded {wheel.name} in {time.monotonic() - start:.1f} s")
    say(f"peer: extracting {MEMBER} from {wheel.name} ...")
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise PeerError(
            f"could not extract {MEMBER} from {wheel}: {e!r}; delete the wheel to download it again"
        ) from e
    SCRIPT.parent.mkdir(parents=True, exist_ok=True)
    tmp = SCRIPT.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(SCRIPT)
    say(f"peer: extracted to {SCRIPT} ({len(data)} bytes)")
    return SCRIPT


def ensure_peer_deps(say=print) -> None:
    """Makes fastapi, uvicorn and orjson importable by this interpreter (pip install if missing)."""
    missing = [m for m in PEER_DEPS if importlib.util.find_spec(m) is None]
    if not missing:
        return
    say(f"peer: installing the peer server's dependencies with pip: {' '.join(missing)}")
    base = [sys.executable, "-m", "pip", "install", "--quiet", *missing]
    proc = subprocess.run(base, capture_output=True, text=True)
    if proc.returncode != 0 and "externally-managed" in (proc.stdout + proc.stderr):
        proc = subprocess.run(base + ["--break-system-packages"], capture_output=True, text=True)
    importlib.invalidate_caches()
    still = [m for m in missing if importlib.util.find_spec(m) is None]
    if proc.returncode != 0 or still:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise PeerError(
            f"could not install {' '.join(missing)} (needed to run vLLM's metadata server): "
            f"pip exited with {proc.returncode}.\n{tail}"
        )
    say(f"peer: installed {' '.join(missing)}")


def load_peer_module(script: Path):
    """Imports the extracted file as a module (for `Hf3fsGlobalMetadataClient`).

    The file calls `logging.basicConfig(level=INFO)` at import; the root logger's handlers and
    level are restored afterwards so that the import does not change pytest's logging.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    spec = importlib.util.spec_from_file_location("vllm_hf3fs_metadata_server", script)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    # The client logs every failed POST at error level; keep it, but not the server's INFO noise.
    logging.getLogger(module.__name__).setLevel(logging.WARNING)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """vLLM's metadata server in a subprocess on a free port; `url` once it answers POST /clear."""

    def __init__(self, script: Path):
        self.script = script
        self.proc = None
        self.url = None
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-peer-", suffix=".log", delete=False)

    def log_tail(self, lines: int = 30) -> str:
        try:
            self.log.flush()
            with open(self.log.name, "r", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "<no log>"

    def start(self) -> str:
        last_error = None
        for _attempt in range(3):  # a free port can be taken between probing and binding
            port = _free_port()
            self.proc = subprocess.Popen(
                [sys.executable, str(self.script), "--host", "127.0.0.1", "--port", str(port)],
                stdout=self.log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=tempfile.gettempdir(),
            )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + START_WAIT_S
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    last_error = f"exited with status {self.proc.returncode}"
                    break
                try:
                    # No /health in the peer; /clear is harmless on a fresh server and answers 204.
                    r = requests.post(f"{url}/clear", timeout=1)
                    if r.status_code == 204:
                        self.url = url
                        return url
                    last_error = f"POST /clear answered {r.status_code}"
                except requests.RequestException as e:
                    last_error = repr(e)
                time.sleep(0.05)
            else:
                last_error = f"POST /clear did not answer 204 within {START_WAIT_S} s"
            self.stop()
        raise PeerError(
            f"vLLM's metadata server did not start: {last_error}\n--- peer log ---\n{self.log_tail()}"
        )

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_WAIT_S)

    def close(self) -> None:
        self.stop()
        self.log.close()
        if os.environ.get("KVPAGES_KEEP_LOG"):
            print(f"peer log kept at {self.log.name}")
        else:
            os.unlink(self.log.name)
