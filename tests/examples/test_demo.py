"""The elastic demo (examples/llama_finetune/demo.py, ``make demo``): end to end, and its checks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from elastic_events.data.sampler import epoch_permutation
from support.launch import clean_env, run

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "llama_finetune"
SRC = Path(__file__).resolve().parents[2] / "src"
if str(EXAMPLE_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_DIR))

from demo import Change, DemoConfig, DemoError, check_samples, summarize  # noqa: E402


@pytest.mark.slow
def test_demo_grows_to_three_and_shrinks_with_every_check_passing(tmp_path: Path) -> None:
    """The demo's own scenario (1 -> 2 -> 3 -> 2 ranks), with fewer steps, through its command line."""
    cmd = [
        sys.executable,
        str(EXAMPLE_DIR / "demo.py"),
        "--run-dir",
        str(tmp_path),
        "--steps",
        "70",
        "--schedule",
        "join:node-2@3,join:node-3@20,leave:node-2@40",
        "--min-step-time",
        "0.25",
        "--timeout",
        "400",
    ]
    env = clean_env(PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = run(cmd, timeout=450, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["problems"] == []
    assert [r["world_size"] for r in summary["rounds"]] == [1, 2, 3, 2]
    assert [(e["from_world"], e["to_world"]) for e in summary["scale_events"]] == [(1, 2), (2, 3), (3, 2)]
    for event in summary["scale_events"]:
        assert 0 < event["downtime_s"] < 120
        assert sum(event["phases"].values()) == pytest.approx(event["downtime_s"])
    assert summary["steps_trained"] == 70 and summary["samples_seen"] == 70 * 8 and summary["exactly_once"]
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["exit_codes"] == {"node-1": 0, "node-2": 0, "node-3": 0}
    out = proc.stdout
    assert "OK: every check passed" in out
    assert "SIGTERM to node-2" in out
    assert any(line.startswith("[") and "world 3 | step" in line for line in out.splitlines()), (
        "no status line at world 3"
    )


# ------------------------------------------------------------------------ the checks


def records_for(
    steps: int, worlds: list[int], *, num_samples: int = 50, global_batch: int = 4, seed: int = 1
) -> list[dict]:
    """A sample log as train.py writes it when step s runs at world size worlds[s - 1]."""
    out = []
    for step, world in zip(range(1, steps + 1), worlds, strict=True):
        epoch, position = divmod((step - 1) * global_batch, (num_samples // global_batch) * global_batch)
        batch = epoch_permutation(num_samples, seed=seed, epoch=epoch)[position : position + global_batch].tolist()
        for rank in range(world):
            out.append({"step": step, "rank": rank, "world_size": world, "sample_ids": batch[rank::world]})
    return out


def test_check_samples_accepts_an_exactly_once_log_across_world_sizes_and_epochs() -> None:
    records = records_for(30, [1] * 5 + [3] * 10 + [2] * 15)  # 12 steps per epoch: crosses two epoch ends
    assert check_samples(records, num_samples=50, global_batch=4, seed=1, steps=30) == []


@pytest.mark.parametrize("damage", ["repeat", "skip", "step_twice", "missing_step"])
def test_check_samples_reports_every_kind_of_damage(damage: str) -> None:
    records = records_for(10, [2] * 10)
    if damage == "repeat":  # a rank trained a sample of the previous step again
        records[6]["sample_ids"][0] = records[4]["sample_ids"][0]
    elif damage == "skip":  # a sample of the permutation never trained, another one instead
        records[6]["sample_ids"][0] = epoch_permutation(50, seed=1, epoch=0)[49].item()
    elif damage == "step_twice":  # a rank's step replayed after a restart
        records.append(dict(records[6]))
    else:
        records = [r for r in records if r["step"] != 5]
    problems = check_samples(records, num_samples=50, global_batch=4, seed=1, steps=10)
    assert len(problems) == 1
    expected = {
        "repeat": "step 4:",
        "skip": "step 4:",
        "step_twice": "step 4: logged by ranks [0, 0, 1]",
        "missing_step": "steps missing [5]",
    }
    assert expected[damage] in problems[0]


def test_summary_reads_world_sizes_and_downtime_phases_off_the_logs(tmp_path: Path) -> None:
    config = DemoConfig(
        run_dir=tmp_path, steps=4, global_batch=4, seed=1, schedule=(Change(at_step=2, action="join", node="node-2"),)
    )
    t = 1000.0
    events = [
        {"ts": t + 1, "event": "rendezvous_done", "round": 1, "world_size": 1},
        {"ts": t + 5, "event": "scale_decided", "round": 1, "world_size": 1, "reason": "standby vm-7 available"},
        {"ts": t + 3.5, "event": "checkpoint_saved", "round": 1, "world_size": 1, "step": 1},  # a periodic save
        {"ts": t + 7, "event": "checkpoint_saved", "round": 1, "world_size": 1, "step": 2},
        {"ts": t + 9, "event": "rendezvous_done", "round": 2, "world_size": 2},
        {"ts": t + 9.5, "event": "rendezvous_done", "round": 2, "world_size": 2},  # the second launcher's record
        {"ts": t + 12, "event": "checkpoint_loaded", "round": 2, "world_size": 2, "step": 2},
        {"ts": t + 13, "event": "first_step", "round": 2, "world_size": 2, "step": 3},
        {"ts": t + 14, "event": "job_succeeded", "round": 2, "world_size": 2},
    ]
    ends = {1: t + 3, 2: t + 6.5, 3: t + 13, 4: t + 14}  # end of each step
    metrics = [{"ts": ts, "step": s, "loss": 6.0 - s, "world_size": 1 if s <= 2 else 2} for s, ts in ends.items()]
    for name, rows in (("events", events), ("metrics", metrics), ("samples", records_for(4, [1, 1, 2, 2]))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(
        config,
        num_samples=50,
        started=t,
        exit_codes={"node-1": 0, "node-2": 0},
        problems=[],
        names=lambda text: text.replace("vm-7", "node-2"),
    )
    assert summary.problems == ()
    assert summary.world_sizes == (1, 2)
    assert [(r.first_step, r.last_step) for r in summary.rounds] == [(1, 2), (3, 4)]
    (event,) = summary.scale_events
    assert event.mode == "restart" and event.downtime_s == pytest.approx(6.5)
    assert event.phases == pytest.approx(
        {"save": 0.5, "stop + rendezvous": 2.0, "start + load": 3.0, "first step": 1.0}
    )
    assert event.reason == "standby node-2 available"
    assert (summary.first_loss, summary.final_loss) == (5.0, 2.0)
    assert summary.exactly_once and "16 samples in 4 steps, each seen exactly once" in summary.render()


def test_summary_of_an_in_place_event_splits_its_downtime_at_the_trainers_records(tmp_path: Path) -> None:
    config = DemoConfig(
        run_dir=tmp_path, steps=4, global_batch=4, seed=1, schedule=(Change(at_step=2, action="join", node="node-2"),)
    )
    t = 1000.0
    events = [
        {"ts": t + 1, "event": "rendezvous_done", "round": 1, "world_size": 1},
        {"ts": t + 2.5, "event": "scale_decided", "round": 1, "world_size": 1, "reason": "standby vm-7 available"},
        {"ts": t + 4.2, "event": "group_torn_down", "round": 2, "world_size": 2, "step": 2},
        {"ts": t + 5.0, "event": "group_up", "round": 2, "world_size": 2},
        {"ts": t + 5.3, "event": "hydrated", "round": 2, "world_size": 2, "step": 2},
        {"ts": t + 5.6, "event": "first_step", "round": 2, "world_size": 2, "step": 3},
        {"ts": t + 5.7, "event": "rendezvous_done", "round": 2, "world_size": 2, "in_place": True},  # after step 3
        {"ts": t + 7, "event": "job_succeeded", "round": 2, "world_size": 2},
    ]
    ends = {1: t + 3, 2: t + 4, 3: t + 5.6, 4: t + 6}
    metrics = [{"ts": ts, "step": s, "loss": 6.0 - s, "world_size": 1 if s <= 2 else 2} for s, ts in ends.items()]
    for name, rows in (("events", events), ("metrics", metrics), ("samples", records_for(4, [1, 1, 2, 2]))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(config, num_samples=50, started=t, exit_codes={"node-1": 0, "node-2": 0}, problems=[])
    assert summary.problems == ()
    assert [(r.first_step, r.last_step) for r in summary.rounds] == [(1, 2), (3, 4)]
    (event,) = summary.scale_events
    assert event.mode == "in place" and event.downtime_s == pytest.approx(1.6)
    assert event.phases == pytest.approx(
        {"group torn down": 0.2, "rendezvous + group up": 0.8, "hydrated": 0.3, "first step": 0.3}
    )
    assert "in place: downtime 1.6s" in summary.render()


def test_steps_trained_at_the_old_size_on_the_way_to_the_agreed_step_are_not_downtime(tmp_path: Path) -> None:
    """The agents record the new round when the event is decided; the ranks train at the old size until the
    agreed step. Downtime runs from the last step at the old size (step 4 here), as in the benchmarks; the
    survivors' pause is that less one normal step."""
    config = DemoConfig(
        run_dir=tmp_path, steps=6, global_batch=4, seed=1, schedule=(Change(at_step=2, action="join", node="node-2"),)
    )
    t = 1000.0
    events = [
        {"ts": t + 0.5, "event": "rendezvous_done", "round": 1, "world_size": 1},
        {"ts": t + 1.4, "event": "scale_decided", "round": 1, "world_size": 1, "reason": "standby vm-7 available"},
        {"ts": t + 1.5, "event": "rendezvous_done", "round": 2, "world_size": 2, "in_place": True},  # decided
        {"ts": t + 4.2, "event": "group_torn_down", "round": 2, "world_size": 2, "step": 4},
        {"ts": t + 4.3, "event": "group_up", "round": 2, "world_size": 2},
        {"ts": t + 4.4, "event": "hydrated", "round": 2, "world_size": 2, "step": 4},
        {"ts": t + 5.5, "event": "first_step", "round": 2, "world_size": 2, "step": 5},
        {"ts": t + 7, "event": "job_succeeded", "round": 2, "world_size": 2},
    ]
    ends = {1: t + 1, 2: t + 2, 3: t + 3, 4: t + 4, 5: t + 5.5, 6: t + 6.5}  # one step a second
    metrics = [{"ts": ts, "step": s, "loss": 7.0 - s, "world_size": 1 if s <= 4 else 2} for s, ts in ends.items()]
    for name, rows in (("events", events), ("metrics", metrics), ("samples", records_for(6, [1, 1, 1, 1, 2, 2]))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(config, num_samples=50, started=t, exit_codes={"node-1": 0, "node-2": 0}, problems=[])
    assert summary.problems == ()
    assert [(r.world_size, r.first_step, r.last_step) for r in summary.rounds] == [(1, 1, 4), (2, 5, 6)]
    (event,) = summary.scale_events
    assert (event.at_step, event.downtime_s, event.pause_s) == (4, pytest.approx(1.5), pytest.approx(0.5))
    assert "in place: downtime 1.5s, survivors paused 0.5s" in summary.render()


def test_summary_fails_when_the_world_sizes_miss_the_schedule(tmp_path: Path) -> None:
    config = DemoConfig(
        run_dir=tmp_path, steps=2, global_batch=4, seed=1, schedule=(Change(at_step=1, action="join", node="node-2"),)
    )
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"ts": 1.0, "event": "rendezvous_done", "round": 1, "world_size": 1}) + "\n"
    )
    summary = summarize(config, num_samples=50, started=0.0, exit_codes={"node-1": 1}, problems=[])
    assert not summary.ok
    text = "\n".join(summary.problems)
    assert "world sizes over time were (), the schedule expects (1, 2)" in text  # no step trained at any size
    assert "no job_succeeded record" in text
    assert "launcher node-1 exited with 1" in text
    assert not summary.exactly_once
    assert "NOT exactly once" in summary.render() and "FAILED:" in summary.render()


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("leave:node-1@5", "node-1 hosts the rendezvous store"),
        ("join:node-2@5,join:node-2@9", "node-2 joins twice"),
        ("leave:node-3@5", "node-3 leaves but is not running"),
        ("join:node-2@9,join:node-3@5", "must come after step 9"),
        ("join:node-2@50", "before the last step 20"),
        ("grow:node-2@5", "action must be join or leave"),
        ("join:node-2", "expected ACTION:NODE@STEP"),
    ],
)
def test_bad_schedules_are_refused_before_anything_starts(tmp_path: Path, schedule: str, message: str) -> None:
    with pytest.raises(DemoError, match=message):
        DemoConfig(run_dir=tmp_path, steps=20, schedule=tuple(Change.parse(x) for x in schedule.split(",")))
