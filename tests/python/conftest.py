"""Fixtures: one `kvpages serve` process for the session, a clean state for every test.

The binary is `$KVPAGES_BIN`, or `<repo>/target/debug/kvpages` where `<repo>` is two directories
above this file. Build it first: `cargo build -p kvpages`.
"""

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

import peer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO_ROOT / "target" / "debug" / "kvpages"
HEALTH_WAIT_S = 10.0


def _binary() -> Path:
    path = Path(os.environ.get("KVPAGES_BIN", DEFAULT_BIN))
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"kvpages binary not found at {path}: run `cargo build -p kvpages` "
            "in the repo root or set KVPAGES_BIN",
            pytrace=False,
        )
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log_path: str, lines: int = 40) -> str:
    try:
        with open(log_path, "r", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "<no log>"


def _stop(proc: subprocess.Popen) -> None:
    peer.stop_process(proc)


def _start(binary: Path, log_file, extra_args=()):
    """Starts the server on a free port; returns (process, base URL) once /health answers 200.
    `extra_args` are added to `serve`'s flags (not `--eviction`: a flag may appear once)."""
    last_error = None
    for _attempt in range(3):  # a free port can be taken between probing and binding
        port = _free_port()
        proc = subprocess.Popen(
            # --eviction off: exactly vLLM's server's behaviour (a full pool answers -1), which
            # these tests compare against page by page.
            [str(binary), "serve", "--host", "127.0.0.1", "--port", str(port), "--log", "warn", "--eviction", "off",
             *extra_args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=tempfile.gettempdir(),
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HEALTH_WAIT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                last_error = f"exited with status {proc.returncode}"
                break
            try:
                if requests.get(f"{base}/health", timeout=1).status_code == 200:
                    return proc, base
            except requests.RequestException as e:
                last_error = repr(e)
            time.sleep(0.05)
        else:
            last_error = f"/health did not answer 200 within {HEALTH_WAIT_S} s"
        _stop(proc)
    raise RuntimeError(f"kvpages did not start: {last_error}")


@pytest.fixture(scope="session")
def server_url():
    """Base URL of a running `kvpages serve` (stopped with SIGTERM at the end of the session)."""
    binary = _binary()
    log = tempfile.NamedTemporaryFile(prefix="kvpages-test-", suffix=".log", delete=False)
    try:
        try:
            proc, base = _start(binary, log)
        except RuntimeError as e:
            log.flush()
            pytest.fail(f"{e}\n--- server log ---\n{_log_tail(log.name)}", pytrace=False)
        try:
            yield base
        finally:
            _stop(proc)
            assert proc.returncode is not None
    finally:
        log.close()
        if os.environ.get("KVPAGES_KEEP_LOG"):
            print(f"server log kept at {log.name}")
        else:
            os.unlink(log.name)


@pytest.fixture
def base_url(server_url):
    """The server, cleared (POST /clear) before the test."""
    r = requests.post(f"{server_url}/clear", timeout=5)
    assert r.status_code == 204, (r.status_code, r.text)
    assert r.content == b""
    health = requests.get(f"{server_url}/health", timeout=5).json()
    assert health["keys"] == 0 and health["ranks"] == [] and health["world_size"] == 0, health
    return server_url


class _Servers:
    """`kvpages_server(*flags)`: see the fixture."""

    def __init__(self):
        self.binary = _binary()
        self.running = {}  # url -> (process, log file)
        # A fresh server must start empty: with a binary that keeps its state on disk (by default
        # in ./kvpages-data), ask it to keep the state in memory only.
        help_text = subprocess.run([str(self.binary), "serve", "--help"], capture_output=True,
                                   text=True, timeout=30).stdout
        self.base_flags = ("--in-memory",) if "--in-memory" in help_text else ()

    def __call__(self, *flags: str) -> str:
        log = tempfile.NamedTemporaryFile(prefix="kvpages-test-", suffix=".log", delete=False)
        flags = self.base_flags + flags
        try:
            proc, base = _start(self.binary, log, flags)
        except RuntimeError as e:
            log.flush()
            tail = _log_tail(log.name)
            log.close()
            os.unlink(log.name)
            pytest.fail(f"{e} (flags: {' '.join(flags)})\n--- server log ---\n{tail}", pytrace=False)
        self.running[base] = (proc, log)
        return base

    def stop(self, url: str) -> None:
        proc, log = self.running.pop(url)
        _stop(proc)
        log.close()
        if os.environ.get("KVPAGES_KEEP_LOG"):
            print(f"server log kept at {log.name}")
        else:
            os.unlink(log.name)

    def stop_all(self) -> None:
        for url in list(self.running):
            self.stop(url)


@pytest.fixture(scope="module")
def kvpages_server():
    """Starts further `kvpages serve` processes for one test module: `kvpages_server(*flags)`
    returns the base URL of a fresh, empty server started with `--eviction off` plus `flags`
    (and `--in-memory` when the binary has it); `kvpages_server.stop(url)` stops one, and the
    rest stop at the end of the module. For tests
    that need a state of their own (SGLang's rank:namespace pools are not dropped by the vLLM
    `/clear` that `base_url` sends) or other settings."""
    servers = _Servers()
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture(scope="module")
def say(pytestconfig):
    """Prints straight to the terminal (a download's progress is worth seeing under -q)."""
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")

    def _say(msg: str) -> None:
        if capman is None:
            print(msg, flush=True)
            return
        with capman.global_and_fixture_disabled():
            print("\n" + msg, end="", flush=True)

    return _say


def record_retries(client) -> list:
    """Wraps a peer client's `requests` session so every response's urllib3 retry history is
    kept (an empty history: the call succeeded at its first try)."""
    histories = []
    post = client._session.post

    def recorded(*args, **kwargs):
        r = post(*args, **kwargs)
        histories.append(r.raw.retries.history if r.raw.retries is not None else ())
        return r

    client._session.post = recorded
    return histories


def metric(url: str, series: str) -> float:
    """One series' value from `GET /metrics` (`series` as printed, labels included)."""
    text = requests.get(f"{url}/metrics", timeout=5).text
    line = next(l for l in text.splitlines() if l.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])
