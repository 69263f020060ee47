"""The container image, built from the repository's Dockerfile and run.

`cargo xtask test` builds the image with buildah (no daemon needed) from the binary it just built
(`--build-arg KVPAGES_BINARY=prebuilt`), on a `debian:bookworm-slim` base it makes with
debootstrap when no registry is reachable, and names it in `$KVPAGES_IMAGE`. These tests read the
image's configuration and run it as buildah runs a container: the image's own filesystem (its
libc, its user), its environment, a host directory mounted on its volume.
"""

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

IMAGE = os.environ.get("KVPAGES_IMAGE", "")
BUILDAH = ["buildah", "--storage-driver", os.environ.get("KVPAGES_BUILDAH_STORAGE", "vfs")]
UID = 10001


@pytest.fixture(scope="module")
def config():
    if not IMAGE:
        pytest.fail("set KVPAGES_IMAGE to the image to test (cargo xtask test builds one)", pytrace=False)
    out = subprocess.run(BUILDAH + ["inspect", "--type", "image", IMAGE], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["Docker"]["config"]


def test_the_image_runs_kvpages_serve_as_a_non_root_user_with_its_state_in_a_volume(config):
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["kvpages"]
    assert config["Cmd"] == ["serve"]
    assert config["Volumes"] == {"/var/lib/kvpages": {}}
    assert config["WorkingDir"] == "/var/lib/kvpages"
    assert config["ExposedPorts"] == {"18000/tcp": {}}
    assert "KVPAGES_HOST=0.0.0.0" in config["Env"]
    assert "KVPAGES_DATA_DIR=/var/lib/kvpages/data" in config["Env"]
    assert config["StopSignal"] == "SIGTERM"
    assert config["Healthcheck"]["Test"] == ["CMD", "kvpages", "stats"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Container:
    """One working container of the image, with `volume` mounted on /var/lib/kvpages."""

    def __init__(self, volume: Path):
        self.name = subprocess.run(
            BUILDAH + ["from", "--pull=never", IMAGE], check=True, capture_output=True, text=True
        ).stdout.strip()
        self.volume = volume
        self.proc = None

    def run(self, *argv, **kw):
        return subprocess.run(
            BUILDAH + ["run", "--isolation", "chroot", "-v", f"{self.volume}:/var/lib/kvpages", self.name, "--", *argv],
            **kw,
        )

    def start(self, config, port: int) -> str:
        """The image's entrypoint and command, on a loopback port (tests bind 127.0.0.1 only)."""
        argv = config["Entrypoint"] + config["Cmd"] + ["--host", "127.0.0.1", "--port", str(port)]
        self.argv = argv
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        self.proc = subprocess.Popen(
            BUILDAH
            + ["run", "--isolation", "chroot", "-v", f"{self.volume}:/var/lib/kvpages", self.name, "--", *argv],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except requests.RequestException:  # not listening yet, or still starting
                pass
            assert self.proc.poll() is None, f"the container exited: {self.tail()}"
            time.sleep(0.2)
        raise AssertionError(f"no /health within 60 s: {self.tail()}")

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def server_pid(self) -> int:
        """The container's kvpages process (buildah's chroot isolation does not pass signals on)."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit():
                    continue
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
                # argv[0] as the image's PATH resolved it: /usr/local/bin/kvpages
                if argv[1:] == self.argv[1:] and argv[0].rsplit("/", 1)[-1] == self.argv[0]:
                    pids.append(int(entry.name))
            except OSError:
                pass
        assert len(pids) == 1, f"expected one process running {self.argv}, found {pids}"
        return pids[0]

    def stop(self):
        """SIGTERM to the server, as `docker stop` sends it (the image's STOPSIGNAL): it exits 0."""
        pid = self.server_pid()
        status = Path(f"/proc/{pid}/status").read_text()
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        assert uid_line.split()[1:] == [str(UID)] * 4, f"the server runs as {uid_line}"
        os.kill(pid, signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0, self.tail()
        assert "shutting down" in self.tail()

    def remove(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(BUILDAH + ["rm", self.name], capture_output=True)


@pytest.fixture
def volume():
    with tempfile.TemporaryDirectory() as d:
        # A fresh named volume takes the ownership of the image's /var/lib/kvpages; a bind mount
        # has to be given it.
        os.chown(d, UID, UID)
        os.chmod(d, 0o700)
        yield Path(d)


def test_the_container_serves_keeps_its_state_in_the_volume_and_passes_its_healthcheck(config, volume):
    key = "0123456789abcdef0123456789abcdef"
    box = Container(volume)
    try:
        port = _free_port()
        url = box.start(config, port)
        health = requests.get(f"{url}/health").json()
        assert health["status"] == "serving"
        assert health["engine"] == "wasm", "the image's binary must embed the plugin (the default engine)"
        assert requests.post(f"{url}/rank/0/initialize", json={"num_pages": 8, "role": "worker"}).json() == {
            "message": "Rank 0 initialized with 8 pages"
        }
        assert requests.post(f"{url}/keys/batch_allocate", json={"rank": 0, "keys": [[key, ""]]}).json() == {
            "rank": 0,
            "results": [[key, 0]],
        }
        confirm = {"rank": 0, "confirmations": [[key, 0]], "pages_to_release": []}
        assert requests.post(f"{url}/keys/confirm_write", json=confirm).status_code == 204
        # The simulator is embedded too.
        page = requests.get(f"{url}/simulator/")
        assert page.status_code == 200 and "kvpages" in page.text and "pkg/" in page.text
        # The HEALTHCHECK's command, inside the container (it dials its default URL, so point it
        # at the test's port as KVPAGES_URL would).
        check = box.run(*config["Healthcheck"]["Test"][1:], "--url", url, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert '"keys"' in check.stdout
        box.stop()
        # The state is in the volume, written by the image's user.
        data = volume / "data"
        files = list(data.iterdir())
        assert files, "nothing written to the volume"
        assert {f.stat().st_uid for f in files} == {UID}
        # A new container on the same volume has the key, on the same page.
        box.remove()
        box = Container(volume)
        url = box.start(config, _free_port())
        assert requests.post(f"{url}/keys/batch_exists", json={"keys": [key]}).json() == {"exists": [True]}
        assert requests.post(f"{url}/keys/get_locations", json={"rank": 0, "keys": [key]}).json() == {
            "locations": [0]
        }
        box.stop()
    finally:
        box.remove()
