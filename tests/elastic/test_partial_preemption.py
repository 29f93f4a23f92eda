"""hyperpodctl against a running job: yield replicas, cap, lift the cap; the job follows."""

from __future__ import annotations

import json
import subprocess
import sys

from support.launch import clean_env


def _ctl(job, *args: str) -> subprocess.CompletedProcess:
    rdzv_id = job.base[job.base.index("--rdzv-id") + 1]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperpodrun.ctl",
            *args,
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            job.endpoint,
            "--rdzv-id",
            rdzv_id,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )


def test_yield_then_uncap_shrinks_and_grows_back(make_job) -> None:
    job = make_job(nnodes="1:2", flags=("--scaling-timeout", "5"))
    job.start_node("a")
    job.start_node("b")
    step2 = job.wait_for_nodes(2)
    status = json.loads(_ctl(job, "status", "--json").stdout)
    assert len(status["members"]) == 2 and status["world_size"] == job.world(2)
    proc = _ctl(job, "yield", "1")
    assert proc.returncode == 0, proc.stderr
    step1 = job.wait_for_nodes(1, after_step=step2)
    assert json.loads(_ctl(job, "status", "--json").stdout)["cap"] == 1
    job.wait_steps(5)
    assert _ctl(job, "uncap").returncode == 0
    job.wait_for_nodes(2, after_step=step1)
    job.wait_steps(3)
    assert job.finish() == {"a": 0, "b": 0}
    steps = [p["step"] for p in job.progress()]
    assert steps == list(range(1, len(steps) + 1))  # neither change lost a step
    reasons = [e["reason"] for e in job.events("scale_decided")]
    assert any("cap" in r for r in reasons)
