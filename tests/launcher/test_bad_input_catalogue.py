"""The bad-input catalogue: every way a user can hold it wrong, and what they get back.

One table; each row runs ``hyperpodrun``, ``hyperpodctl`` or the example's ``train.py``
in this process (their ``main``) and asserts: a non-zero exit, exactly one line on stderr
that starts ``<program>: error:`` and names the problem, no traceback, no worker started
and, for checkpoint rows, no saved checkpoint lost. docs/troubleshooting.md lists the rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_events.checkpoint import CheckpointConfig, Checkpointer, list_checkpoints, verify_checkpoint
from elastic_events.data.sampler import ElasticSampler
from hyperpodrun import agent, cli, ctl
from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.rendezvous.decider import DeciderContext
from hyperpodrun.rendezvous.elastic import ElasticRendezvous
from hyperpodrun.store import create_store
from support.impostor import Impostor
from support.launch import SCRIPTS
from support.ports import free_port

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "llama_finetune"
SCRIPT = str(SCRIPTS / "allreduce.py")
SECRET = "0123456789abcdef0123456789abcdef"
TRAIN_SMALL = ["--seq-len", "64", "--global-batch", "6", "--micro-batch", "2", "--num-workers", "0"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: who runs, with what, and the words its single error line must contain."""

    tool: str  # hyperpodrun | hyperpodctl | train.py
    argv: tuple[str, ...]
    expect: str
    setup: Callable[[Ctx], None] | None = None


class Ctx:
    """What a row's argv may refer to (``{name}``); setups add entries."""

    def __init__(self, tmp: Path, request: pytest.FixtureRequest) -> None:
        self.tmp, self.request = tmp, request
        self.values: dict[str, str] = {"script": SCRIPT, "tmp": str(tmp), "free": f"127.0.0.1:{free_port()}"}
        self.ckpt: Path | None = None  # the checkpoint folder whose contents must survive

    def fixture(self, name: str) -> Any:
        return self.request.getfixturevalue(name)


# ----------------------------------------------------------------------------- setups


def _write(ctx: Ctx, name: str, text: str, mode: int = 0o644) -> Path:
    path = ctx.tmp / name
    path.write_text(text)
    path.chmod(mode)
    ctx.values[name.split(".")[0]] = str(path)
    return path


def policy(text: str) -> Callable[[Ctx], None]:
    return lambda ctx: _write(ctx, "policy.yaml", text) and None


def not_executable(ctx: Ctx) -> None:
    _write(ctx, "tool.sh", "#!/bin/sh\necho hi\n", mode=0o644)


def world_readable_secret(ctx: Ctx) -> None:
    _write(ctx, "secret.txt", SECRET, mode=0o644)


def garbage_ca(ctx: Ctx) -> None:
    _write(ctx, "ca.pem", "-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")


def running_job(*, nproc: int, min_replicas: int, max_replicas: int) -> Callable[[Ctx], None]:
    """Another agent already in job ``dup`` on an embedded store this test hosts."""

    def setup(ctx: Ctx) -> None:
        stack: contextlib.ExitStack = ctx.fixture("exit_stack")
        store = create_store("c10d", "127.0.0.1:0", run_id="dup", conf={}, host=True, timeout=10.0)
        ctx.values["store"] = store.inner.endpoint
        context = DeciderContext(
            policy=ElasticPolicy(min_replicas=min_replicas, max_replicas=max_replicas),
            nproc_per_node=nproc,
            max_restarts=0,
            lease_ttl=10.0,
            ack_timeout=30.0,
            propagation=1.0,
            tick=0.2,
        )
        other = ElasticRendezvous(store, context=context, local_addr="127.0.0.1", join_timeout=60.0, node_id="node-a")
        other.join()
        stack.callback(other.shutdown, succeeded=False)

    return setup


def empty_store(ctx: Ctx) -> None:
    stack: contextlib.ExitStack = ctx.fixture("exit_stack")
    store = stack.enter_context(create_store("c10d", "127.0.0.1:0", run_id="nobody", conf={}, host=True, timeout=10.0))
    ctx.values["store"] = store.inner.endpoint


def port_held_by_another_program(ctx: Ctx) -> None:
    """Another (local) user's program on the job's loopback store port, answering as a store without a secret."""
    impostor = Impostor(auth=False)
    ctx.fixture("exit_stack").callback(impostor.close)
    ctx.values["store"] = impostor.endpoint


# ---- checkpoint folders for train.py


def _copy_good(ctx: Ctx, into: Path) -> Path:
    good: Path = ctx.fixture("good_checkpoints")
    shutil.copytree(good, into)
    ctx.ckpt = into
    ctx.values["ckpt"] = str(into)
    return into


def ckpt_is_a_file(ctx: Ctx) -> None:
    _write(ctx, "ckpt", "not a folder")


def ckpt_under_a_file(ctx: Ctx) -> None:
    _write(ctx, "plain.txt", "x")
    ctx.values["ckpt"] = str(ctx.tmp / "plain.txt" / "checkpoints")


def ckpt_read_only(ctx: Ctx) -> None:
    ctx.values["ckpt"] = str(ctx.fixture("mount")("ro", size="1m"))


def ckpt_disk_full(ctx: Ctx) -> None:
    good: Path = ctx.fixture("good_checkpoints")
    size = sum(p.stat().st_size for p in good.rglob("*") if p.is_file())
    root = ctx.fixture("mount")("rw", size=f"{size * 3 // 2 // 1024 + 64}k")  # room for one, not two
    _copy_good(ctx, root / "checkpoints")


def _damage(mutate: Callable[[Path], None]) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        root = _copy_good(ctx, ctx.tmp / "checkpoints")
        mutate(next(root.glob("step_*")))

    return setup


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 3)])


corrupt_shard = _damage(lambda step: _truncate(next(step.glob("*.distcp"))))
truncated_metadata = _damage(lambda step: _truncate(step / ".metadata"))


def wrong_model(ctx: Ctx) -> None:
    """A sound checkpoint of some other model, in the folder the Llama run resumes from."""
    root = ctx.tmp / "checkpoints"
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    data = ElasticSampler(12, global_batch=6, micro_batch=2, rank=0, world_size=1)
    Checkpointer(CheckpointConfig(dir=root)).save(1, model=model, optimizer=optimizer, scheduler=scheduler, data=data)
    ctx.ckpt, ctx.values["ckpt"] = root, str(root)


# ----------------------------------------------------------------------------- the catalogue

H, C, T = "hyperpodrun", "hyperpodctl", "train.py"
ELASTIC = ("--rdzv-backend", "c10d", "--nnodes", "1:2")

CATALOGUE: dict[str, Case] = {
    # hyperpodrun flags
    "unknown-flag": Case(H, ("--bogus-flag", "{script}"), "No such option: --bogus-flag"),
    "nnodes-min-above-max": Case(H, ("--nnodes", "3:2", "{script}"), "--nnodes: MIN must not exceed MAX"),
    "nnodes-not-a-number": Case(H, ("--nnodes", "a:b", "{script}"), "--nnodes: expected N or MIN:MAX"),
    "nnodes-zero": Case(H, ("--nnodes", "0", "{script}"), "--nnodes: the minimum must be >= 1"),
    "nproc-zero": Case(H, ("--nproc-per-node", "0", "{script}"), "--nproc-per-node: must be >= 1"),
    "nproc-word": Case(H, ("--nproc-per-node", "many", "{script}"), "--nproc-per-node: expected a positive integer"),
    "backend-unknown": Case(H, ("--rdzv-backend", "zookeeper", "{script}"), "unknown backend 'zookeeper'"),
    "backend-etcd-v2": Case(H, ("--rdzv-backend", "etcd-v2", "{script}"), "etcd v2 API is not supported"),
    "rdzv-conf-malformed": Case(H, ("--rdzv-conf", "timeout", "{script}"), "--rdzv-conf: expected key=value"),
    "rdzv-conf-typo": Case(
        H, (*ELASTIC, "--rdzv-conf", "lease_tll=5", "{script}"), "--rdzv-conf: unknown key 'lease_tll'"
    ),
    "redirects-out-of-range": Case(H, ("--redirects", "7", "{script}"), "--redirects: expected 0, 1, 2 or 3"),
    "tee-rank-out-of-range": Case(
        H, ("--nproc-per-node", "2", "--tee", "5:1", "{script}"), "local rank 5 out of range"
    ),
    "max-restarts-negative": Case(H, ("--max-restarts", "-1", "{script}"), "--max-restarts: must be >= 0"),
    "monitor-interval-zero": Case(H, ("--monitor-interval", "0", "{script}"), "--monitor-interval: must be > 0"),
    "signal-unknown": Case(H, ("--signals-to-handle", "SIGNOPE", "{script}"), "unknown signal 'SIGNOPE'"),
    "standalone-multi-node": Case(H, ("--standalone", "--nnodes", "2", "{script}"), "--standalone runs one node"),
    "master-port-out-of-range": Case(H, ("--master-port", "70000", "{script}"), "--master-port: must be in 0..65535"),
    "node-rank-out-of-range": Case(
        H, ("--nnodes", "2", "--node-rank", "5", "{script}"), "--node-rank: 5 is out of range"
    ),
    "module-and-no-python": Case(
        H, ("-m", "--no-python", "{script}"), "-m/--module and --no-python cannot be used together"
    ),
    "elastic-with-static-backend": Case(
        H, ("--nnodes", "1:4", "{script}"), "an elastic job needs a rendezvous backend"
    ),
    "rdzv-id-path": Case(H, ("--rdzv-id", "../etc", "{script}"), "--rdzv-id '../etc' is not a valid job id"),
    "rdzv-id-too-long": Case(H, ("--rdzv-id", "j" * 64, "{script}"), "the limit is 63"),
    "start-method-unknown": Case(H, ("--start-method", "thread", "{script}"), "--start-method: expected one of"),
    "max-world-size-too-small": Case(
        H, ("--nproc-per-node", "2", "--max-world-size", "1", "{script}"), "--max-world-size: 1 ranks"
    ),
    "no-script": Case(H, (), "Missing argument"),
    "option-prefix-ambiguous": Case(H, ("--r", "3", "{script}"), "ambiguous option: --r could match"),
    "monitor-interval-nan": Case(H, ("--monitor-interval", "nan", "{script}"), "--monitor-interval: must be > 0"),
    "snapshot-every-word": Case(
        H, ("--snapshot-every", "often", "{script}"), "--snapshot-every: expected 'auto' or an integer >= 0"
    ),
    "snapshot-every-negative": Case(
        H, ("--snapshot-every", "-1", "{script}"), "--snapshot-every: expected 'auto' or an integer >= 0"
    ),
    "shutdown-timeout-inf": Case(H, ("--shutdown-timeout", "inf", "{script}"), "--shutdown-timeout: must be >= 0"),
    "rdzv-conf-infinite": Case(
        H, (*ELASTIC, "--rdzv-conf", "lease_ttl=inf", "{script}"), "lease_ttl: must be a finite number of seconds"
    ),
    "nproc-xpu-absent": Case(H, ("--nproc-per-node", "xpu", "{script}"), "--nproc-per-node xpu: no XPU device"),
    "local-addr-not-this-machine": Case(
        H, (*ELASTIC, "--local-addr", "203.0.113.5", "{script}"), "--local-addr 203.0.113.5: not an address of this"
    ),
    "log-dir-cannot-be-created": Case(H, ("--log-dir", "/proc/x", "{script}"), "--log-dir /proc/x: cannot create"),
    "event-log-is-a-folder": Case(H, ("--event-log", "{tmp}", "{script}"), "is a folder; give the path of a file"),
    "standalone-with-endpoint": Case(
        H, ("--standalone", "--rdzv-endpoint", "127.0.0.1:29400", "{script}"), "--standalone hosts its own store"
    ),
    "local-ranks-filter-out-of-range": Case(
        H, ("--local-ranks-filter", "7", "{script}"), "local rank(s) 7 out of range for --nproc-per-node 1"
    ),
    # scripts
    "script-missing": Case(H, ("missing.py",), "training script 'missing.py' not found"),
    "script-is-a-directory": Case(H, ("{tmp}",), "is a directory"),
    "script-not-executable": Case(H, ("--no-python", "{tool}"), "is not executable (chmod +x it)", not_executable),
    "executable-missing": Case(H, ("--no-python", "no-such-binary-xyz"), "executable 'no-such-binary-xyz' not found"),
    # policy files
    "policy-file-with-static-backend": Case(
        H,
        ("--elastic-policy", "{policy}", "{script}"),
        "need a store-backed rendezvous",
        policy("minReplicas: 1\nmaxReplicas: 2\n"),
    ),
    "policy-file-missing": Case(
        H,
        (*ELASTIC, "--elastic-policy", "/nonexistent.yaml", "{script}"),
        "cannot read elastic policy file /nonexistent.yaml",
    ),
    "policy-min-above-max": Case(
        H,
        ("--rdzv-backend", "c10d", "--elastic-policy", "{policy}", "{script}"),
        "max_replicas",
        policy("minReplicas: 4\nmaxReplicas: 2\n"),
    ),
    "policy-unknown-key": Case(
        H,
        ("--rdzv-backend", "c10d", "--elastic-policy", "{policy}", "{script}"),
        "unknown key 'minReplica'",
        policy("minReplica: 1\nmaxReplicas: 2\n"),
    ),
    "policy-not-yaml": Case(
        H,
        ("--rdzv-backend", "c10d", "--elastic-policy", "{policy}", "{script}"),
        "invalid YAML",
        policy("minReplicas: [1\n"),
    ),
    "policy-step-and-values": Case(
        H,
        ("--rdzv-backend", "c10d", "--elastic-policy", "{policy}", "{script}"),
        "replica",
        policy("minReplicas: 1\nmaxReplicas: 4\nreplicaIncrementStep: 1\nreplicaDiscreteValues: [1, 2]\n"),
    ),
    "policy-negative-timeout": Case(
        H,
        ("--rdzv-backend", "c10d", "--elastic-policy", "{policy}", "{script}"),
        "graceful_shutdown_timeout",
        policy("minReplicas: 1\nmaxReplicas: 2\ngracefulShutdownTimeoutInSeconds: -1\n"),
    ),
    # endpoints and stores
    "etcd-without-endpoint": Case(
        H, ("--rdzv-backend", "etcd", "--nnodes", "1:2", "{script}"), "needs --rdzv-endpoint"
    ),
    "etcd-endpoint-with-scheme": Case(
        H,
        ("--rdzv-backend", "etcd", "--rdzv-endpoint", "http://127.0.0.1:2379", "--nnodes", "1:2", "{script}"),
        "without a scheme",
    ),
    "etcd-endpoint-bad-port": Case(
        H,
        ("--rdzv-backend", "etcd", "--rdzv-endpoint", "h:99999", "--nnodes", "1:2", "{script}"),
        "invalid port '99999'",
    ),
    "etcd-unreachable": Case(
        H,
        (
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "{free}",
            "--rdzv-conf",
            "store_timeout=1",
            "--nnodes",
            "1:2",
            "{script}",
        ),
        "is unreachable after",
    ),
    "embedded-two-endpoints": Case(
        H, (*ELASTIC, "--rdzv-endpoint", "127.0.0.1:1,127.0.0.1:2", "{script}"), "takes one --rdzv-endpoint"
    ),
    "embedded-off-loopback-without-secret": Case(
        H, (*ELASTIC, "--rdzv-endpoint", "192.0.2.1:29400", "{script}"), "needs a shared secret"
    ),
    "embedded-secret-file-world-readable": Case(
        H,
        (*ELASTIC, "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf", "secret_file={secret}", "{script}"),
        "is accessible to other users",
        world_readable_secret,
    ),
    "embedded-port-held-by-another-program": Case(
        H,
        (*ELASTIC, "--rdzv-endpoint", "{store}", "{script}"),
        "does not prove it knows this job's secret",
        port_held_by_another_program,
    ),
    "store-key-typo": Case(
        H,
        (
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "{free}",
            "--rdzv-conf",
            "passwd=x",
            "--nnodes",
            "1:2",
            "{script}",
        ),
        "unknown key 'passwd' for --rdzv-backend etcd",
    ),
    # TLS and credentials
    "tls-cacert-missing": Case(
        H,
        (
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "{free}",
            "--rdzv-conf",
            "cacert=/nonexistent/ca.pem",
            "--nnodes",
            "1:2",
            "{script}",
        ),
        "cacert: file '/nonexistent/ca.pem' does not exist",
    ),
    "tls-cert-without-key": Case(
        H,
        (
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "{free}",
            "--rdzv-conf",
            "cert={script}",
            "--nnodes",
            "1:2",
            "{script}",
        ),
        "key is required when cert is given",
    ),
    "tls-http-with-cacert": Case(
        H,
        (
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "{free}",
            "--rdzv-conf",
            "protocol=http,cacert={script}",
            "--nnodes",
            "1:2",
            "{script}",
        ),
        "protocol 'http' contradicts cacert",
    ),
    "tls-cacert-not-a-certificate": Case(
        H,
        (
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "{free}",
            "--rdzv-conf",
            "cacert={ca}",
            "--nnodes",
            "1:2",
            "{script}",
        ),
        "is not a PEM CA certificate file",
        garbage_ca,
    ),
    "etcd-password-over-http": Case(
        H,
        (
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "{free}",
            "--rdzv-conf",
            "user=u,password=p",
            "--nnodes",
            "1:2",
            "{script}",
        ),
        "refusing to send the etcd password over plain http",
    ),
    # two launches that disagree
    "two-jobs-one-rdzv-id": Case(
        H,
        ("--rdzv-backend", "c10d", "--rdzv-endpoint", "{store}", "--rdzv-id", "dup", "--nnodes", "1:4", "{script}"),
        "node node-a of this job runs with --nnodes (MAX) 2, this node with 4",
        running_job(nproc=1, min_replicas=1, max_replicas=2),
    ),
    "nproc-differs-between-nodes": Case(
        H,
        (
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "{store}",
            "--rdzv-id",
            "dup",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "{script}",
        ),
        "runs with --nproc-per-node 1, this node with 2",
        running_job(nproc=1, min_replicas=1, max_replicas=2),
    ),
    # hyperpodctl
    "ctl-without-rdzv-id": Case(C, ("status",), "Missing option '--rdzv-id'"),
    "ctl-bad-rdzv-id": Case(C, ("status", "--rdzv-id", "a/b"), "--rdzv-id 'a/b' is not a valid job id"),
    "ctl-cap-negative": Case(C, ("cap", "--rdzv-id", "j", "--", "-1"), "Invalid value for 'replicas'"),
    "ctl-yield-zero": Case(C, ("yield", "0", "--rdzv-id", "j"), "Invalid value for 'count'"),
    "ctl-store-unreachable": Case(
        C,
        ("status", "--rdzv-backend", "etcd", "--rdzv-endpoint", "{free}", "--rdzv-id", "j", "--store-timeout", "0.5"),
        "is unreachable",
    ),
    "ctl-no-such-job": Case(
        C,
        ("status", "--rdzv-backend", "c10d", "--rdzv-endpoint", "{store}", "--rdzv-id", "nobody"),
        "no job with --rdzv-id nobody",
        empty_store,
    ),
    # checkpoint folders (the example's train.py)
    "ckpt-dir-is-a-file": Case(T, ("--ckpt-dir", "{ckpt}"), "exists and is not a directory", ckpt_is_a_file),
    "ckpt-dir-cannot-be-created": Case(
        T, ("--ckpt-dir", "{ckpt}"), "cannot create checkpoint directory", ckpt_under_a_file
    ),
    "ckpt-dir-read-only": Case(T, ("--ckpt-dir", "{ckpt}"), "is not writable: Read-only file system", ckpt_read_only),
    "ckpt-disk-full": Case(T, ("--ckpt-dir", "{ckpt}", "--steps", "3", "--ckpt-every", "1"), "is full", ckpt_disk_full),
    "ckpt-corrupt-shard": Case(T, ("--ckpt-dir", "{ckpt}"), "truncated", corrupt_shard),
    "ckpt-truncated-metadata": Case(T, ("--ckpt-dir", "{ckpt}"), "unreadable .metadata", truncated_metadata),
    "ckpt-wrong-model": Case(T, ("--ckpt-dir", "{ckpt}"), "has no model entry", wrong_model),
}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def exit_stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def good_checkpoints(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """A real checkpoint of the example (step 1), made once; rows copy it."""
    root = tmp_path_factory.mktemp("good") / "checkpoints"
    argv = [*TRAIN_SMALL, "--data-cache", str(data_cache), "--ckpt-dir", str(root), "--steps", "1"]
    code = _train(argv)
    assert code == 0 and [info.step for info in list_checkpoints(root)] == [1]
    return root


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount a small tmpfs (``rw`` or ``ro``) for this test; needs root, as CI runs."""
    mounted: list[Path] = []

    def mount_(mode: str, *, size: str) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},{mode}", "tmpfs", str(point)], check=True, capture_output=True
        )
        mounted.append(point)
        return point

    yield mount_
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


def _train(argv: list[str]) -> int:
    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    import train

    return train.main(argv)


@pytest.fixture
def plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HYPERPODRUN_CONTROL_FILE"):
        monkeypatch.delenv(name, raising=False)  # train.py as a plain script
    for name in [k for k in os.environ if k.startswith(("PET_", "HYPERPODRUN_"))]:
        monkeypatch.delenv(name)  # nothing from the environment may change the flags under test


def _snapshot(root: Path | None) -> dict[str, int]:
    if root is None or not root.exists():
        return {}
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- the test


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_input(
    name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    plain_process: None,
) -> None:
    case = CATALOGUE[name]
    ctx = Ctx(tmp_path, request)
    if case.setup is not None:
        case.setup(ctx)
    argv = [arg.format(**ctx.values) for arg in case.argv]
    started: list[object] = []
    monkeypatch.setattr(
        agent.Agent, "_start_group", lambda self, *a: started.append(a) or pytest.fail("workers started")
    )
    before = _snapshot(ctx.ckpt)
    capsys.readouterr()
    if case.tool == H:
        code = cli.main(argv)
    elif case.tool == C:
        code = ctl.main(argv)
    else:
        code = _train([*TRAIN_SMALL, "--data-cache", str(request.getfixturevalue("data_cache")), *argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code != 0, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{case.tool}: error: "), lines[0]
    assert case.expect in lines[0], lines[0]
    assert "Traceback" not in err
    assert not started
    if ctx.ckpt is not None:
        after = _snapshot(ctx.ckpt)
        assert {k: v for k, v in after.items() if k in before} == before, "a saved checkpoint changed or vanished"
        if name == "ckpt-disk-full":
            [kept] = list_checkpoints(ctx.ckpt)
            verify_checkpoint(kept.path)  # the step saved before the disk filled is intact


def test_the_catalogue_is_documented() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    missing = [name for name in CATALOGUE if f"`{name}`" not in text]
    assert not missing, f"docs/troubleshooting.md does not list {missing}"
    assert len(CATALOGUE) >= 40
