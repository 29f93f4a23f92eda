"""docs/k8s/*.yaml against the Kubernetes API schema (offline: kubernetes-validate ships the schemas), and
the rules that make them behave like the Slurm recipe (docs/kubernetes.md).

Kubernetes ends a pod (kubectl delete pod, preemption, drain and other evictions, a suspended Job) with
preStop hooks, SIGTERM to each container's PID 1, and SIGKILL after terminationGracePeriodSeconds; only
PID 1 is signalled. So hyperpodrun must be PID 1 (exec form, no shell), the grace period must cover a
leave, and a pod killed before it could leave must not count as the job's failure. The manifests use
no custom resources: every kind is validated by the core schema, strictly (no unknown field).
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import typer
import yaml

from hyperpodrun.cli import app

K8S = Path(__file__).resolve().parents[2] / "docs" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
#: The oldest release with podFailurePolicy as stable, and the newest the package knows.
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def jobs() -> list[tuple[str, dict]]:
    return [(f"{p.name}:{d['metadata']['name']}", d) for p in MANIFESTS for d in documents(p) if d["kind"] == "Job"]


def launcher_flags(command: list[str]) -> dict[str, str]:
    """``--name=value`` flags before the training script."""
    flags = {}
    for arg in command[1:]:
        if not arg.startswith("--"):
            break
        name, _, value = arg.partition("=")
        flags[name] = value
    return flags


def test_every_manifest_is_found() -> None:
    assert {p.name for p in MANIFESTS} >= {"etcd.yaml", "training-job.yaml", "join-job.yaml", "priority-classes.yaml"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_match_the_kubernetes_api_schema(path: Path, version: str) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field


def test_a_wrong_field_is_caught() -> None:
    """The check can fail: a field the API does not have, or a value of the wrong type."""
    (_, job) = jobs()[0]
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 150
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "150s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


@pytest.mark.parametrize(("name", "job"), jobs(), ids=[n for n, _ in jobs()])
def test_training_pods_take_sigterm_as_a_graceful_leave(name: str, job: dict) -> None:
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[0] == "hyperpodrun", f"{name}: SIGTERM goes to PID 1, which must be the launcher (no shell)"
    assert "args" not in container
    flags = launcher_flags(command)
    known = {o for p in typer.main.get_command(app).params for o in getattr(p, "opts", ())}
    assert set(flags) <= known, f"{name}: unknown launcher flags {set(flags) - known}"
    graceful = float(flags.get("--graceful-shutdown-timeout", 120))
    assert pod["terminationGracePeriodSeconds"] > graceful, f"{name}: SIGKILL could come before the leave ends"
    assert pod["restartPolicy"] == "Never"  # a launcher that left or finished is not started again in place
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert "--ckpt-every" in {a.partition("=")[0] for a in command}


def test_the_first_allocation_outranks_the_extra_nodes() -> None:
    classes = {d["metadata"]["name"]: d for d in documents(K8S / "priority-classes.yaml")}
    priority = {name: classes[job["spec"]["template"]["spec"]["priorityClassName"]]["value"] for name, job in jobs()}
    assert priority["training-job.yaml:llama-ft"] > priority["join-job.yaml:llama-ft-extra"]
    same = {name: launcher_flags(job["spec"]["template"]["spec"]["containers"][0]["command"]) for name, job in jobs()}
    first, extra = same["training-job.yaml:llama-ft"], same["join-job.yaml:llama-ft-extra"]
    assert first == extra, "every launcher of a job must be given the same flags"
