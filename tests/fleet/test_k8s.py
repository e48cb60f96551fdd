"""infra/k8s/worker-deployment.yaml: the worker's command and its readiness probe are command
lines deltastore's own parser accepts, and the probe answers as docs/fleet.md says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from deltastore import Publisher
from deltastore.cli import EXIT_FAILED, EXIT_OK, build_parser, main
from deltastore.fleet.ledger import HeartbeatWriter
from deltastore.storage import open_store
from testkit.tensors import small_state

yaml = pytest.importorskip("yaml")

DEPLOYMENT = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "worker-deployment.yaml"
POD = "deltastore-workers-7d9f-x2x4q"


def _container() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(DEPLOYMENT.read_text(encoding="utf-8")) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables as a pod sees them (the pod name for the downward API)."""
    out = {}
    for e in container["env"]:
        if "value" in e:
            out[e["name"]] = e["value"]
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            out[e["name"]] = POD
        else:
            out[e["name"]] = f"<secret {e['name']}>"
    return out


def _expand(words: list[str], env: dict[str, str], pattern: str) -> list[str]:
    return [re.sub(pattern, lambda m: env[m.group(1)], w) for w in words]


def _probe(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The probe's deltastore arguments: its ``sh -c`` script split as sh would, "$VAR" expanded."""
    command = container["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"], command
    words = shlex.split(command[2])
    assert words[0] == "deltastore"
    return _expand(words[1:], env, r"\$([A-Z_]+)")


def test_the_worker_follows_as_its_pod_with_credentials_from_a_secret() -> None:
    c = _container()
    env = _env(c)
    assert c["command"] == ["deltastore"]
    # Kubernetes expands $(VAR) in command and args (not in probes)
    args = build_parser().parse_args(_expand(c["args"], env, r"\$\(([A-Z_]+)\)"))
    assert (args.command, args.follow, args.worker_id) == ("pull", True, POD)
    assert args.url == env["DELTASTORE_URL"] and args.trusted_key == ["/keys/trusted.pub"]
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secrets)
    assert not any("value" in e and e["name"].startswith("AWS_SECRET") for e in c["env"])


def test_the_readiness_probe_is_the_status_check_of_this_pod() -> None:
    c = _container()
    args = build_parser().parse_args(_probe(c, _env(c)))
    assert (args.command, args.worker, args.ready_within) == ("status", POD, 1)
    assert args.trusted_key == ["/keys/trusted.pub"]
    probe = c["readinessProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 20  # a retarget must not empty the Service


def test_the_probe_answers_for_a_store_signed_with_the_trusted_key(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    pub = tmp_path / "trusted.pub"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    url = str(tmp_path / "store")
    state = small_state()
    with Publisher(url, signing_key=key) as p:
        for _ in range(3):
            state = {k: v + 1 for k, v in state.items()}
            p.publish(state)
    c = _container()
    env = {**_env(c), "DELTASTORE_URL": url}
    argv = [str(pub) if w == "/keys/trusted.pub" else w for w in _probe(c, env)]
    assert main(argv) == EXIT_FAILED  # no heartbeat yet: not ready
    with open_store(url) as store:
        HeartbeatWriter(store, POD).beat(2)
    assert main(argv) == EXIT_OK  # one version behind head: within 1
    with open_store(url) as store:
        HeartbeatWriter(store, POD).beat(1)
    assert main(argv) == EXIT_FAILED
