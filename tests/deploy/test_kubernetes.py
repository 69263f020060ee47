"""The Kubernetes manifests in deploy/kubernetes: valid against Kubernetes' own schemas (offline,
with `kubernetes-validate --strict`), and in step with the image and the server they run."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy/kubernetes").glob("*.yaml"))
DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_every_manifest_passes_kubernetes_validate_strict():
    tool = shutil.which("kubernetes-validate")
    if not tool:
        pytest.fail("kubernetes-validate not found: pip install kubernetes-validate (cargo xtask test does)", pytrace=False)
    assert MANIFESTS
    for path in MANIFESTS:
        out = subprocess.run([tool, "--strict", "--no-warn", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, f"{path.name}:\n{out.stdout}{out.stderr}"
        assert "passed" in out.stdout and "failed" not in out.stdout, out.stdout


def docs():
    return {
        (d["kind"], d["metadata"]["name"]): d
        for path in MANIFESTS
        for d in yaml.safe_load_all(path.read_text())
        if d
    }


@pytest.fixture(scope="module")
def server():
    sts = docs()[("StatefulSet", "kvpages")]
    return sts, sts["spec"]["template"]["spec"]["containers"][0]


def test_the_statefulset_runs_one_server_as_the_images_user_on_its_volume(server):
    sts, c = server
    assert sts["spec"]["replicas"] == 1
    image_uid = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M)
    pod = sts["spec"]["template"]["spec"]["securityContext"]
    assert (str(pod["runAsUser"]), str(pod["runAsGroup"])) == image_uid.groups()
    assert pod["fsGroup"] == pod["runAsGroup"] and pod["runAsNonRoot"] is True
    volume = re.search(r"^VOLUME (\S+)$", DOCKERFILE, re.M).group(1)
    assert c["volumeMounts"] == [{"name": "data", "mountPath": volume}]
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVPAGES_DATA_DIR"].startswith(volume + "/")
    exposed = re.search(r"^EXPOSE (\d+)$", DOCKERFILE, re.M).group(1)
    assert c["ports"] == [{"name": "http", "containerPort": int(exposed), "protocol": "TCP"}]
    svc = docs()[("Service", "kvpages")]
    assert svc["spec"]["ports"][0]["port"] == int(exposed)
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == exposed


def test_every_variable_and_route_it_uses_is_one_kvpages_serve_has(server):
    _, c = server
    binary = os.environ.get("KVPAGES_BIN", str(REPO / "target/debug/kvpages"))
    help_text = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True, check=True).stdout
    known = set(re.findall(r"\[env: (KVPAGES_\w+)[=\]]", help_text))
    assert len(known) > 10
    used = {e["name"] for e in c["env"]}
    assert used <= known, f"not variables of kvpages serve: {used - known}"
    assert c["args"] == ["serve"]
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["tcpSocket"] == {"port": "http"}


def test_the_memory_it_asks_for_holds_the_measured_ten_million_keys_and_a_snapshot(server):
    _, c = server
    run = json.loads((REPO / "docs/bench/memory.json").read_text())
    assert (run["keys"], run["ranks"]) == (10_000_000, 2)
    wasm = next(e for e in run["engines"] if e["engine"] == "wasm")

    def gib(q: str) -> float:
        assert q.endswith("Gi"), q
        return float(q[:-2])

    request = gib(c["resources"]["requests"]["memory"]) * 2**30
    limit = gib(c["resources"]["limits"]["memory"]) * 2**30
    assert request >= wasm["rss_after_kib"] * 1024, "the request does not hold the measured state"
    assert limit >= 1.2 * wasm["snapshot_peak_rss_kib"] * 1024, "the limit leaves under 20 % over a snapshot's peak"
    comment = (REPO / "deploy/kubernetes/kvpages.yaml").read_text()
    assert f"{round(wasm['rss_per_key_bytes'])} bytes a key" in comment


def test_the_vllm_example_forwards_localhost_18000_to_the_service_and_may_pass_the_policy():
    all_docs = docs()
    vllm = all_docs[("Deployment", "vllm")]["spec"]["template"]
    sidecar = next(c for c in vllm["spec"]["initContainers"] if c["name"] == "kvpages-forward")
    assert sidecar["restartPolicy"] == "Always", "a sidecar: it runs beside vLLM for the pod's life"
    svc = all_docs[("Service", "kvpages")]
    assert sidecar["args"] == ["forward", "--to", f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"]
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    # vLLM's connector dials localhost:18000, whatever its configuration says.
    assert env == {"KVPAGES_FORWARD_LISTEN": "127.0.0.1:18000"}
    binary = os.environ.get("KVPAGES_BIN", str(REPO / "target/debug/kvpages"))
    help_text = subprocess.run([binary, "forward", "--help"], capture_output=True, text=True, check=True).stdout
    assert "[env: KVPAGES_FORWARD_LISTEN=" in help_text
    policy = all_docs[("NetworkPolicy", "kvpages")]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert policy.items() <= vllm["metadata"]["labels"].items()
    assert sidecar["image"] == all_docs[("StatefulSet", "kvpages")]["spec"]["template"]["spec"]["containers"][0]["image"]
