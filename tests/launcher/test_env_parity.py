"""A worker sees torchrun's environment key for key (run the same probe under both launchers)."""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import SCRIPTS, clean_env, hyperpodrun_cmd, run, torchrun_cmd

# Values that are per-launch by nature (ports, ids, temp paths) are compared by presence only.
PER_LAUNCH = {
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "MASTER_ADDR",
    "TORCHELASTIC_USE_AGENT_STORE",
}
# Values hyperpodrun sets otherwise on purpose (docs/torchrun_flags.md): NCCL errors reach Python (2, CleanUpOnly)
# for the in-process repair, where torchrun's 1 (TearDown) kills the rank.
DELIBERATE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def _envs(cmd: list[str], out: Path) -> dict[int, dict[str, str]]:
    out.mkdir()
    proc = run([*cmd, str(SCRIPTS / "dump_env.py"), str(out)], env=clean_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("env_*.json")}


def test_worker_environment_matches_torchrun(tmp_path: Path) -> None:
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    ours = _envs(hyperpodrun_cmd(*flags), tmp_path / "ours")
    theirs = _envs(torchrun_cmd(*flags), tmp_path / "torchrun")
    assert sorted(ours) == sorted(theirs) == [0, 1]
    base = clean_env()
    for rank in (0, 1):
        ours_keys = {k for k in ours[rank] if not k.startswith("HYPERPODRUN_")}
        assert ours_keys == set(theirs[rank]), (
            f"only ours: {sorted(ours_keys - set(theirs[rank]))}; only torchrun: {sorted(set(theirs[rank]) - ours_keys)}"
        )
        for key, value in theirs[rank].items():
            if key in DELIBERATE:
                assert ours[rank][key] == DELIBERATE[key], key
            elif key not in PER_LAUNCH and base.get(key) != value:
                assert ours[rank][key] == value, key
    assert ours[1]["RANK"] == "1" and ours[1]["WORLD_SIZE"] == "2" and ours[1]["LOCAL_WORLD_SIZE"] == "2"
    assert ours[0]["MASTER_PORT"] == ours[1]["MASTER_PORT"]
    assert ours[0]["HYPERPODRUN_RESTART_REASON"] == "start"
    control = Path(ours[0]["HYPERPODRUN_CONTROL_FILE"])
    assert control == Path(ours[1]["HYPERPODRUN_CONTROL_FILE"]) and control.parent.name.startswith("hyperpodrun-")
    assert not control.parent.exists()  # the agent removed its private channel directory on exit


def test_omp_num_threads_set_only_when_unset(tmp_path: Path) -> None:
    env = clean_env()
    env.pop("OMP_NUM_THREADS")
    out = tmp_path / "a"
    out.mkdir()
    proc = run(hyperpodrun_cmd("--nproc-per-node", "2", str(SCRIPTS / "dump_env.py"), str(out)), env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "env_0.json").read_text())["OMP_NUM_THREADS"] == "1"
    out = tmp_path / "b"
    out.mkdir()
    proc = run(
        hyperpodrun_cmd("--nproc-per-node", "2", str(SCRIPTS / "dump_env.py"), str(out)),
        env=clean_env(OMP_NUM_THREADS="3"),
    )
    assert json.loads((out / "env_1.json").read_text())["OMP_NUM_THREADS"] == "3"
