"""Keep the benchmarks working: their analysis functions, and every script end to end in ``--smoke``.

The end-to-end tests run each ``benchmarks/<name>.py --smoke`` as a real process and check
the structure and sanity of its JSON result and that its plot was written. They assert
no timing thresholds: this machine's speed is not what they test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from support.bench_events import event

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "benchmarks"
SCRIPT_TIMEOUT_S = 600
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- pure functions


def test_percentile_interpolates_between_ranks(bench: Any) -> None:
    common: ModuleType = bench("common")
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert common.percentile(values, 0) == 1.0
    assert common.percentile(values, 100) == 5.0
    assert common.median(values) == 3.0
    assert common.percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    assert common.percentile(range(1, 101), 99) == pytest.approx(99.01)
    with pytest.raises(ValueError, match="no values"):
        common.percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        common.percentile([1.0], 101)


def test_summarize_reports_every_statistic(bench: Any) -> None:
    s = bench("common").summarize([1, 2, 3, 4])
    assert s == {"n": 4, "median": 2.5, "p99": pytest.approx(3.97), "min": 1.0, "max": 4.0, "mean": 2.5}


def test_format_table_aligns_and_marks_missing(bench: Any) -> None:
    table = bench("common").format_table(["name", "value"], [("a", 1.23456), ("bb", None)])
    lines = table.splitlines()
    assert lines[0].split() == ["name", "value"]
    assert lines[2].split() == ["a", "1.235"]
    assert lines[3].split() == ["bb", "-"]
    assert len({len(line) for line in lines}) == 1


def test_wall_tokens_per_s_uses_step_end_times(bench: Any) -> None:
    common = bench("common")
    records = [{"ts": 100.0 + 0.5 * s, "step": s} for s in range(1, 11)]
    # steps 3..10 after skipping 2: 7 steps of 1000 tokens in 3.5 s
    assert common.wall_tokens_per_s(records, 1000, skip=2) == pytest.approx(2000.0)
    with pytest.raises(common.BenchmarkError, match="at least 2 logged steps"):
        common.wall_tokens_per_s(records, 1000, skip=9)


def test_ratio_ci_is_the_geometric_mean_with_a_t_interval(bench: Any) -> None:
    common = bench("common")
    ci = common.ratio_ci([0.98, 1.0, 1.02, 1.0])
    assert ci["n"] == 4 and ci["ratio"] == pytest.approx(0.99993, abs=1e-4)
    # sd of the logs ~0.01633, t(3) = 3.182: half width ~2.6 %
    assert ci["ci_low"] == pytest.approx(0.9741, abs=1e-3) and ci["ci_high"] == pytest.approx(1.0265, abs=1e-3)
    assert ci["half_width_pct"] == pytest.approx(2.63, abs=0.05)
    assert common.ratio_ci([0.95, 0.95])["ci_low"] == pytest.approx(0.95)  # no spread, no width
    with pytest.raises(ValueError, match="at least 2 positive"):
        common.ratio_ci([1.0])


def test_steady_costs_divides_cpu_by_the_steps_in_its_window(bench: Any) -> None:
    so = bench("step_overhead")
    records = [{"ts": 100.0 + 0.5 * s, "step": s} for s in range(1, 21)]  # step s ends at 100 + s/2
    # the ranks burn 0.8 CPU s per wall second, the launcher 0.1; sampled every 0.2 s from t = 99
    samples = [(99.0 + 0.2 * i, 0.1 * 0.2 * i, 0.8 * 0.2 * i) for i in range(60)]
    c = so.steady_costs(records, samples, skip=4)
    assert c["median_step_s"] == pytest.approx(0.5)
    assert c["rank_cpu_per_step_s"] == pytest.approx(0.4) and c["launcher_cpu_per_step_s"] == pytest.approx(0.05)
    assert c["cpu_per_step_s"] == pytest.approx(0.45)
    assert c["cpu_window_steps"] == pytest.approx(14.8, abs=0.01)  # samples from t=102.6 to t=110.0
    with pytest.raises(so.BenchmarkError, match="CPU samples"):
        so.steady_costs(records, samples[:5], skip=4)
    with pytest.raises(so.BenchmarkError, match="logged steps"):
        so.steady_costs(records, samples, skip=19)


def test_steady_costs_start_after_the_spare_is_ready(bench: Any) -> None:
    so = bench("step_overhead")
    records = [{"ts": 100.0 + 0.5 * s, "step": s} for s in range(1, 21)]
    # 1.0 CPU s per wall second until the spare is ready at t = 105.2 (its import), 0.4 after
    samples = [(t, 0.0, min(t, 105.2) - 99.0 + 0.4 * max(0.0, t - 105.2)) for t in (99.0 + 0.2 * i for i in range(60))]
    before = so.steady_costs(records, samples, skip=4)
    after = so.steady_costs(records, samples, skip=4, after_ts=105.2)
    assert before["window_first_step"] == 5 and after["window_first_step"] == 11  # step 11 ends at 105.5
    assert after["rank_cpu_per_step_s"] == pytest.approx(0.2)  # 0.4 CPU s per second, 0.5 s steps
    assert before["rank_cpu_per_step_s"] > 0.3
    # fewer than 3 steps after it: the window stays where the warm-up ends
    assert so.steady_costs(records, samples, skip=4, after_ts=109.5)["window_first_step"] == 5


def test_first_record_ts_reads_hyperpodruns_event_log(bench: Any, tmp_path: Path) -> None:
    common = bench("common")
    log = tmp_path / "logs" / "run-1" / "events.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text('{"ts": 1.5, "event": "agent_started"}\n{"ts": 4.25, "event": "spare_ready"}\n{"ts": 9.0, "ev')
    assert common.first_record_ts(tmp_path / "logs", "spare_ready") == 4.25
    assert common.first_record_ts(tmp_path / "logs", "first_step") is None
    assert common.first_record_ts(tmp_path / "nothing", "spare_ready") is None


def test_hf_steps_per_s_are_timed_after_the_spare_is_ready(bench: Any) -> None:
    hf = bench("hf_client")
    ends = [10.0 + 0.1 * i for i in range(20)] + [12.0 + 0.02 * i for i in range(1, 51)]  # 10/s, then 50/s
    assert hf._steps_per_s(ends, 5, after_ts=12.0) == pytest.approx(50.0)
    assert hf._steps_per_s(ends, 5) < 40.0
    assert hf._steps_per_s(ends, 5, after_ts=99.0) == hf._steps_per_s(ends, 5)  # no step after it: all count


def test_benchmark_result_validates_and_writes(bench: Any, tmp_path: Path) -> None:
    common = bench("common")
    with pytest.raises(ValueError, match="mode"):
        common.BenchmarkResult(name="x", mode="fast", params={}, baseline="b")
    with pytest.raises(ValueError, match="baseline"):
        common.BenchmarkResult(name="x", mode="smoke", params={}, baseline="")
    result = common.BenchmarkResult(name="demo_bench", mode="smoke", params={"p": 1}, baseline="nothing")
    result.summary["ratio"] = 0.5
    data = json.loads(result.write(tmp_path).read_text())
    assert data["benchmark"] == "demo_bench" and data["mode"] == "smoke"
    assert data["params"] == {"p": 1} and data["summary"] == {"ratio": 0.5}
    assert data["versions"]["torch"] and data["machine"]["logical_cpus"] >= 1
    assert data["plot"] == "demo_bench_smoke.png"
    assert data["tag"] is None


def test_benchmark_result_writes_a_summary_without_samples(bench: Any, tmp_path: Path) -> None:
    common = bench("common")
    result = common.BenchmarkResult(name="demo_bench", mode="quick", tag="fsdp", params={"p": 1}, baseline="nothing")
    result.samples["runs"] = [{"raw": list(range(1000))}]
    result.summary["ratio"] = 0.5
    result.notes.append("a note")
    path = result.write(tmp_path)
    assert path == tmp_path / "demo_bench_fsdp_quick.json"
    full = json.loads(path.read_text())
    summary = json.loads((tmp_path / "summary" / "demo_bench_fsdp_quick.json").read_text())
    assert "samples" not in summary and "plot" not in summary and full["samples"]["runs"][0]["raw"][-1] == 999
    assert summary["full_result"] == "demo_bench_fsdp_quick.json"
    for key in ("schema", "benchmark", "tag", "mode", "started_at", "finished_at", "duration_s", "params"):
        assert summary[key] == full[key], key
    assert summary["summary"] == {"ratio": 0.5} and summary["baseline"] == "nothing"
    assert summary["notes"][0] == "a note" and summary["versions"] == full["versions"]
    assert summary["command"] == full["command"] and summary["command"].startswith("python ")
    assert set(summary["machine"]) == {
        "cpu",
        "logical_cpus",
        "usable_cpus",
        "memory_gib",
        "gpus",
        "loadavg_1m",
        "loadavg_1m_end",
    }
    assert summary["machine"]["loadavg_1m_end"] == full["machine"]["loadavg_1m_end"]
    assert "platform" in full["machine"] and "platform" not in summary["machine"]
    assert isinstance(summary["versions"]["git_commit"], str) and isinstance(summary["versions"]["git_dirty"], list)
    with pytest.raises(ValueError, match="tag"):
        common.BenchmarkResult(name="x", mode="quick", tag="a b", params={}, baseline="b")


def test_result_tag_names_a_sharded_run(bench: Any) -> None:
    common = bench("common")
    assert common.result_tag(common.parse_args("x", argv=[])) == ""
    assert common.result_tag(common.parse_args("x", argv=["--tag", "big"])) == "big"

    def with_train(argv: list[str]) -> Any:
        return common.parse_args("x", add_arguments=common.add_train_arguments, argv=argv)

    assert common.result_tag(with_train(["--train-args=--fsdp --dtype bf16"])) == "fsdp"
    assert common.result_tag(with_train(["--train-args=--dtype bf16"])) == ""
    assert common.result_tag(with_train(["--train-args=--hsdp --dtype fp64"])) == "hsdp"
    assert common.result_tag(with_train(["--train-args=--fsdp", "--tag", "fsdp_bf16"])) == "fsdp_bf16"


def test_command_line_names_the_script_inside_the_repository(bench: Any) -> None:
    common = bench("common")
    script = str(BENCH_DIR / "failures.py")
    assert common._command_line([script, "--quick", "--train-args=--fsdp --x"]) == (
        "python benchmarks/failures.py --quick '--train-args=--fsdp --x'"
    )
    assert common._command_line(["/elsewhere/run.py", "--smoke"]) == "python /elsewhere/run.py --smoke"


def test_train_args_validate_and_build_the_command_line(bench: Any, tmp_path: Path) -> None:
    common = bench("common")
    with pytest.raises(ValueError, match="steps"):
        common.TrainArgs(steps=0)
    args = common.TrainArgs(steps=5, global_batch=4, seq_len=64, min_step_time=0.5, extra=("--fsdp",))
    argv = args.argv(run_dir=tmp_path / "run", data_cache=tmp_path / "cache", metrics=tmp_path / "m.jsonl")
    assert argv[argv.index("--steps") + 1] == "5"
    assert argv[argv.index("--min-step-time") + 1] == "0.5"
    assert argv[argv.index("--log-every") + 1] == "1"
    assert argv[-1] == "--fsdp"
    assert args.tokens_per_step == 256


@pytest.mark.parametrize(
    ("argv", "shape"),
    [
        (["--quick"], (2, 8)),  # nodes of 2 ranks, 4 samples a rank of a node
        (["--smoke"], (1, 4)),  # CI's 2 cores: nodes of one rank
        (["--quick", "--nproc-per-node", "1"], (1, 4)),
        (["--nproc-per-node", "4", "--global-batch", "6"], (4, 6)),  # full mode; both given win
    ],
)
def test_scenarios_run_nodes_of_two_ranks_unless_told_otherwise(bench: Any, argv: list[str], shape: tuple) -> None:
    se, common = bench("scale_events"), bench("common")

    def add(parser: Any) -> None:
        se.add_scenario_arguments(parser, default_launchers="all")

    args = common.parse_args("x", add_arguments=add, argv=argv)
    se.resolve_node_shape(args)
    assert (args.nproc_per_node, args.global_batch) == shape


def test_measure_event_reads_downtime_and_lost_steps(bench: Any) -> None:
    se = bench("scale_events")
    # world 1 until step 12 (t=106), an event at t=105, the restart resumes from checkpoint 10.
    records = [{"ts": 100.0 + 0.5 * s, "step": s, "world_size": 1} for s in range(1, 13)]
    records += [{"ts": 120.0 + 0.5 * i, "step": 11 + i, "world_size": 2} for i in range(3)]
    m = se.measure_event(records, t_event=105.0, to_world=2)
    assert m["downtime_s"] == pytest.approx(120.0 - 106.0)
    assert (m["last_old_step"], m["first_new_step"], m["steps_lost"]) == (12, 11, 2)
    assert m["step_interval_s"] == pytest.approx(0.5) and m["pause_s"] == pytest.approx(14.0 - 0.5)
    assert se.measure_event(records[:12], t_event=105.0, to_world=2) is None  # not recovered yet
    # a cooperative scale event resumes right after the step it saved at
    coop = records[:12] + [{"ts": 115.0, "step": 13, "world_size": 2}]
    assert se.measure_event(coop, t_event=105.0, to_world=2)["steps_lost"] == 0


def test_lost_time_is_the_delay_against_a_run_without_the_event(bench: Any) -> None:
    """Last step N ends at L (steps of 0.5 s). Its redo ends at L + 1.5: the job is where it was at L, 1.5 s late.
    Resuming 4 steps back (N - 3 ends at L + 5) is where an unbroken run was at L - 1.5: 6.5 s late."""
    sa = bench("scale_analysis")
    assert sa.lost_time(1.5, 1, 0.5) == pytest.approx(1.5)
    assert sa.lost_time(5.0, 4, 0.5) == pytest.approx(6.5)
    assert sa.lost_time(0.5, 0, 0.5) == 0.0  # a cooperative event that held up nothing: one normal step


def test_summarize_events_ratios_and_failures(bench: Any) -> None:
    se = bench("scale_events")

    runs = [
        {
            "variant": "hyperpodrun",
            "events": [
                event("join", 1.0, 0, mode="in-place"),
                event("leave", 0.5, 0, mode="in-place"),
                event("leave", 1.5, 0, mode="restart"),
            ],
        },
        {"variant": "hyperpodrun-restart", "events": [event("join", 4.0, 0, mode="restart")]},
        {"variant": "torchrun-noshare", "events": [event("join", 8.0, 4), event("leave", 10.0, 6)]},
        {"variant": "torchrun", "events": [{"kind": "join", "outcome": "hang"}]},
    ]
    s = se.summarize_events(runs)
    assert s["downtime_ratio"]["hyperpodrun"]["torchrun-noshare"] == {"join": 0.125, "leave": 0.1}
    assert s["downtime_ratio"]["hyperpodrun"]["hyperpodrun-restart"] == {"join": 0.25}
    assert s["downtime_ratio"]["hyperpodrun-restart"] == {
        "torchrun-noshare": {"join": 0.5},
        "hyperpodrun": {"join": 4.0},
    }
    assert s["lost_time_ratio"]["hyperpodrun"]["torchrun-noshare"] == {"join": 0.1, "leave": 1.0 / 13.0}
    assert s["pause_ratio"]["hyperpodrun"]["torchrun-noshare"]["join"] == pytest.approx(0.5 / 7.5)
    assert "torchrun" not in s["downtime_ratio"]["hyperpodrun"]
    assert s["by_kind"]["join"]["torchrun"] == {
        "n": 1,
        "ok": 0,
        "outcomes": ["hang"],
        "downtime_median_s": None,
        "pause_median_s": None,
        "lost_time_median_s": None,
        "steps_lost_median": None,
        "detect_median_s": None,
    }
    assert s["by_kind"]["leave"]["hyperpodrun"]["n"] == 2
    assert s["by_kind"]["leave"]["hyperpodrun"]["modes"] == ["in-place", "restart"]
    assert s["steps_lost_median"]["leave"] == {"hyperpodrun": 0, "torchrun-noshare": 6}


def test_hyperpodrun_phases_skip_periodic_saves_and_stop_at_first_step(bench: Any) -> None:
    se = bench("scale_events")
    log = [
        {"ts": 9.0, "event": "checkpoint_saved"},  # before the event
        {"ts": 10.5, "event": "checkpoint_saved"},  # periodic, before the ranks were signalled
        {"ts": 11.0, "event": "scale_decided"},
        {"ts": 11.5, "event": "workers_signalled"},
        {"ts": 12.0, "event": "checkpoint_saved"},
        {"ts": 15.0, "event": "first_step"},
        {"ts": 16.0, "event": "scale_decided"},  # the next event
    ]
    assert se.hyperpodrun_phases(log, 10.0) == {
        "scale_decided": 1.0,
        "workers_signalled": 1.5,
        "checkpoint_saved": 2.0,
        "first_step": 5.0,
    }


def test_hyperpodrun_phases_keep_the_ranks_own_durations(bench: Any) -> None:
    se = bench("scale_events")
    log = [
        {"ts": 11.0, "event": "workers_signalled"},
        {"ts": 13.0, "event": "group_torn_down", "seconds": 0.25},
        {"ts": 13.5, "event": "group_up", "seconds": 0.5},
        {"ts": 13.75, "event": "hydrated", "seconds": 0.2},
        {"ts": 14.5, "event": "first_step"},
    ]
    assert se.hyperpodrun_phases(log, 10.0) == {
        "workers_signalled": 1.0,
        "group_torn_down": 3.0,
        "teardown_s": 0.25,
        "group_up": 3.5,
        "hydrated": 3.75,
        "hydration_own_s": 0.2,
        "first_step": 4.5,
    }


def test_event_mode_reads_the_in_place_rendezvous(bench: Any) -> None:
    se = bench("scale_events")
    admitted = {"ts": 11.0, "event": "rendezvous_done"}  # a joiner's agent logs its admission round first
    in_place = {"ts": 13.0, "event": "rendezvous_done", "in_place": True}
    assert se.event_mode([admitted, in_place], {"first_step": 4.0}, 10.0) == "in-place"
    assert se.event_mode([admitted, in_place], {"first_step": 2.0}, 10.0) == "restart"  # after the first step
    assert se.event_mode([], {"workers_started": 1.0}, 10.0) == "restart"
    assert se.event_mode([], {}, 10.0) == "unknown"


def test_phase_breakdown_by_variant_and_mode(bench: Any) -> None:
    se = bench("scale_events")
    restarts = [
        {
            "workers_signalled": 0.5,
            "checkpoint_saved": 2.5,
            "workers_stopped": 5.5,
            "workers_started": 6.0,
            "first_step": 16.0,
        },
        {
            "workers_signalled": 0.5,
            "checkpoint_saved": 1.5,
            "workers_stopped": 2.5,
            "workers_started": 3.0,
            "first_step": 11.0,
        },
        {"workers_started": 3.0, "first_step": 9.0},  # a node loss: no save
    ]
    in_place = {
        "workers_signalled": 0.5,
        "group_torn_down": 2.0,
        "teardown_s": 0.1,
        "group_up": 2.5,
        "hydrated": 2.75,
        "hydration_own_s": 0.2,
        "first_step": 3.5,
    }
    runs = [
        {"variant": "hyperpodrun-restart", "events": [{"phases_s": p, "mode": "restart"} for p in restarts]},
        {
            "variant": "hyperpodrun",
            "events": [{"phases_s": in_place, "mode": "in-place"}, {"phases_s": restarts[0], "mode": "restart"}],
        },  # a fallback
        {"variant": "torchrun-noshare", "events": [{"phases_s": restarts[0]}]},  # ignored: not ours
    ]
    b = se.phase_breakdown(runs)
    assert set(b) == {"hyperpodrun", "hyperpodrun-restart"}
    assert b["hyperpodrun-restart"] == {"save_median_s": 1.5, "exit_after_save_median_s": 2.0, "restart_median_s": 8.0}
    assert b["hyperpodrun"] == {
        "to_target_median_s": 1.5,
        "group_init_median_s": 0.5,
        "hydration_median_s": 0.25,
        "to_first_step_median_s": 0.75,
        "teardown_median_s": 0.1,
        "hydration_own_median_s": 0.2,
        "save_median_s": 2.0,
        "exit_after_save_median_s": 3.0,
        "restart_median_s": 10.0,
    }
    assert se.phase_breakdown([]) == {}


def test_torchft_survivor_pause_sums_the_time_beyond_a_normal_step(bench: Any) -> None:
    ft = bench("torchft_peer")
    steps = [
        (0.0, 1, True),
        (0.5, 1, True),
        (1.0, 1, True),
        (1.5, 1, True),
        (2.8, 1, False),
        (3.5, 2, True),
        (4.0, 2, True),
    ]
    records = [{"ts": ts, "step": i, "participants": p, "committed": c} for i, (ts, p, c) in enumerate(steps)]
    m = ft.survivor_pause(records, t_event=1.2, participants=2)
    assert m["step_interval_s"] == pytest.approx(0.5)
    assert m["pause_s"] == pytest.approx(0.8 + 0.2)  # 1.5 -> 2.8 and 2.8 -> 3.5, each beyond 0.5
    assert m["longest_step_s"] == pytest.approx(1.3) and m["steps_lost"] == 1 and m["to_new_s"] == pytest.approx(2.3)
    assert ft.survivor_pause(records[:5], t_event=1.2, participants=2) is None  # not at the new size yet
    se = bench("scale_events")
    summary = {"by_kind": {"join": {"hyperpodrun": {"pause_median_s": 0.1}}}}
    assert se.torchft_ratios(summary, {"join": {"pause_median_s": 0.4}, "leave": {"pause_median_s": 2.0}}) == {
        "join": 0.25
    }


def test_event_phases_cover_the_checkpoint_interval(bench: Any) -> None:
    se = bench("scale_events")
    assert sorted(se.event_phase(i, 10) for i in range(10)) == list(range(10))
    assert se.event_phase(3, 0) == 0


def test_loglog_slope(bench: Any) -> None:
    rs = bench("rendezvous_scale")
    assert rs.loglog_slope([8, 64, 512], [1.0, 8.0, 64.0]) == pytest.approx(1.0)
    assert rs.loglog_slope([8, 64], [1.0, 64.0]) == pytest.approx(2.0)
    assert rs.loglog_slope([8], [1.0]) is None


# --------------------------------------------------------------------------- scripts end to end


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One result directory for all scripts, so the example's tokenised data is built once."""
    return tmp_path_factory.mktemp("bench-results")


def run_smoke(name: str, out: Path, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / f"{name}.py"), "--smoke", "--out", str(out), *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        cwd=REPO,
    )
    assert proc.returncode == 0, (
        f"{name} --smoke exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    data = json.loads((out / f"{name}_smoke.json").read_text())
    assert data["benchmark"] == name and data["mode"] == "smoke" and data["schema"] == 1
    assert data["baseline"], "every result names its baseline"
    assert data["machine"]["logical_cpus"] >= 1 and data["versions"]["torch"]
    assert data["summary"] and data["samples"] and data["params"]
    assert (out / data["plot"]).read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary" / f"{name}_smoke.json").read_text())
    assert summary["summary"] == data["summary"] and "samples" not in summary
    # the result is made when the run starts, so its duration, load and versions are the run's
    assert data["duration_s"] >= 1.0, f"{name}: the result was made at the end of the run ({data['duration_s']} s)"
    assert "wrote" in proc.stdout  # the table was printed before the path
    return data


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_step_overhead_smoke(out_dir: Path) -> None:
    s = run_smoke("step_overhead", out_dir)["summary"]
    for key in (
        "check_inside_median_us",
        "check_inside_p99_us",
        "check_outside_median_us",
        "allreduce_gloo_median_us",
        "allreduce_gloo_p99_us",
        "hyperpodrun_tokens_per_s",
        "torchrun_tokens_per_s",
        "throughput_ratio",
        "hyperpodrun_cpu_per_step_s",
        "torchrun_cpu_per_step_s",
        "hyperpodrun_median_step_s",
        "torchrun_median_step_s",
    ):
        assert positive(s[key]), (key, s[key])
    assert s["check_inside_p99_us"] >= s["check_inside_median_us"]
    assert s["check_returned_true"] == 0  # nothing was pending: the check must never fire
    assert s["throughput_ratio"] == pytest.approx(s["hyperpodrun_tokens_per_s"] / s["torchrun_tokens_per_s"])
    for key in ("wall_step_ratio_ci", "cpu_step_ratio_ci"):  # two interleaved pairs in smoke
        ci = s[key]
        assert ci["n"] == 2 and positive(ci["ratio"]) and ci["ci_low"] <= ci["ratio"] <= ci["ci_high"], (key, ci)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_hydration_smoke(out_dir: Path) -> None:
    s = run_smoke("hydration", out_dir)["summary"]
    for key in ("state_mb", "hydration_mb_per_s", "broadcast_mb_per_s", "ratio_to_broadcast"):
        assert positive(s[key]), (key, s[key])
    assert s["ratio_to_broadcast"] == pytest.approx(s["hydration_mb_per_s"] / s["broadcast_mb_per_s"], rel=0.01)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_catch_up_smoke(out_dir: Path) -> None:
    """The joiner's copy, stepped through the survivor's records, ends on the survivor's state in every repetition."""
    data = run_smoke("catch_up", out_dir)
    s = data["summary"]
    assert s["exact"] is True and data["samples"]["exact"] == [True, True]
    for key in ("state_mb", "record_mb", "full_pause_s", "heal_step_slowdown"):
        assert positive(s[key]), (key, s[key])
    assert s["record_mb"] == pytest.approx(s["state_mb"] / 3, rel=0.01)  # AdamW: a gradient per parameter of three
    assert all(r >= 2 for r in s["records"])  # the copy's step, then at least one more before the entry
    assert s["pause_ratio"] == pytest.approx(s["replay_pause_s"] / s["full_pause_s"], rel=0.02, abs=0.05)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_world_reshard_smoke(out_dir: Path) -> None:
    s = run_smoke("world_reshard", out_dir)["summary"]
    for key in ("gather_new_median_s", "gather_dcp_median_s", "load_new_median_s", "load_dcp_median_s", "state_mb"):
        assert positive(s[key]), (key, s[key])
    assert s["gather_speedup"] == pytest.approx(s["gather_dcp_median_s"] / s["gather_new_median_s"], rel=1e-2)
    assert s["load_speedup"] == pytest.approx(s["load_dcp_median_s"] / s["load_new_median_s"], rel=1e-2)
    assert len(s["gather_speedup_per_rep"]) == len(s["load_speedup_per_rep"]) == 1
    assert s["params"] > 4_000_000  # the smoke's embedding alone: 32000 x 128


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_state_scaling_smoke(out_dir: Path) -> None:
    """The tiny model on 2 nodes x 2 ranks through a join, a leave, a rank crash and a node loss."""
    [size] = run_smoke("state_scaling", out_dir)["summary"]["sizes"]
    for key in ("params", "state_bytes_per_rank", "snapshot_interval", "snapshot_overhead", "join_pause_s"):
        assert key in size, key
    for key in ("hydration_over_broadcast", "peak_rss_over_state", "crash_steps_redone", "node_loss_downtime_s"):
        assert key in size, key
    assert "throughput_ratio_vs_torchrun" in size  # None in smoke: no torchrun run
    assert size["model"] == "tiny" and size["failure"] is None, size["failure"]
    assert size["state_bytes_per_rank"] == size["params"] * 16 // 4  # fp32 weights, grads, AdamW's 2 moments
    # a snapshot copies the weights and AdamW's moments (12 bytes a parameter); a rank holds 3 of them
    assert size["snapshot_state_bytes"] == pytest.approx(size["params"] * 12 / 4, rel=0.05)
    assert size["snapshot_memory_ratio"] == pytest.approx(3.0, rel=0.05)
    assert isinstance(size["snapshot_interval"], int) and size["snapshot_interval"] >= 1
    for key in ("peak_rss_over_state", "hydration_over_broadcast", "step_s"):
        assert positive(size[key]), (key, size[key])
    # the round's own calibration: a snapshot's cost is what the steps beside it took over the fastest plain step,
    # clamped at 0, and at the tiny size it can be below the noise of a loaded machine
    overhead = size["snapshot_overhead"]
    assert isinstance(overhead, float) and 0.0 <= overhead < 1.0, overhead
    for kind in ("crash", "node_loss"):
        assert positive(size[f"{kind}_downtime_s"]), (kind, size[f"{kind}_downtime_s"])
        assert size[f"{kind}_restored_from"].startswith("snapshot"), size[f"{kind}_restored_from"]
        assert 0 <= size[f"{kind}_steps_redone"] <= size[f"{kind}_interval"], size


def test_step_overhead_hf_client_smoke(out_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "step_overhead.py"), "--smoke", "--client", "hf", "--out", str(out_dir)],
        check=False,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out_dir / "step_overhead_hf_smoke.json").read_text())
    s = data["summary"]
    assert positive(s["hyperpodrun_callback_steps_per_s"]) and positive(s["torchrun_steps_per_s"])
    assert s["throughput_ratio"] == pytest.approx(s["hyperpodrun_callback_steps_per_s"] / s["torchrun_steps_per_s"])
    assert {r["launcher"] for r in data["samples"]["runs"]} == {"hyperpodrun", "torchrun"}
    assert (out_dir / data["plot"]).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_checkpoint_smoke(out_dir: Path) -> None:
    data = run_smoke("checkpoint", out_dir)
    states = data["samples"]["states"]
    assert [s["state"] for s in states] == ["example-tiny", "synthetic-8MB"]
    for s in states:
        assert s["bytes"] > 0
        for key in (
            "raw_write_gbps",
            "dcp_save_gbps",
            "raw_read_cold_gbps",
            "dcp_load_cold_gbps",
            "save_fraction_of_disk",
            "load_cold_fraction_of_disk",
        ):
            assert positive(s[key]), (s["state"], key, s[key])
    assert states[1]["bytes"] >= 8_000_000  # params + two AdamW moments of the synthetic state
    reshard = data["summary"]["reshard"]
    assert (
        reshard["bytes"] > 0
        and positive(reshard["load_w1_resharded_median_s"])
        and positive(reshard["load_w2_median_s"])
    )


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_rendezvous_scale_smoke(out_dir: Path) -> None:
    data = run_smoke("rendezvous_scale", out_dir)
    runs = data["samples"]["runs"]
    assert sorted((r["backend"], r["n"]) for r in runs) == [
        ("embedded", 8),
        ("embedded", 32),
        ("etcd", 8),
        ("etcd", 32),
    ]
    for r in runs:
        assert r["complete"], r["errors"]
        assert r["completed_nodes"] == r["n"]
        assert positive(r["time_to_all_ranks_s"]) and r["latency_p99_s"] <= r["time_to_all_ranks_s"]
        ops = r["ops_by_kind"]
        assert ops["grant_lease"] == r["n"]  # every node joined with exactly one lease
        assert ops["put"] >= r["n"] and ops["compare_and_swap"] >= 1  # node keys, and the published round
        assert r["ops_per_node_mean"] >= 4
    assert data["summary"]["etcd"]["largest_n_completed"] == 32


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_throughput_smoke(out_dir: Path) -> None:
    rows = run_smoke("throughput", out_dir)["summary"]["by_world"]
    assert [r["world"] for r in rows] == [1, 2]
    assert rows[0]["efficiency"] == 1.0 and rows[0]["speedup"] == 1.0
    for r in rows:
        assert positive(r["tokens_per_s"]) and positive(r["efficiency"])


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_scale_events_smoke(out_dir: Path) -> None:
    data = run_smoke("scale_events", out_dir, "--step-time", "0.25")  # half the default: figures are not checked
    runs = {r["variant"]: r for r in data["samples"]["runs"]}
    assert set(runs) == {"hyperpodrun", "torchrun-noshare"}
    ours = runs["hyperpodrun"]
    assert ours["failure"] is None, ours["failure"]
    assert [(e["kind"], e["from_world"], e["to_world"], e["outcome"]) for e in ours["events"]] == [
        ("join", 1, 2, "ok"),
        ("yield", 2, 1, "ok"),
    ]
    for ev in ours["events"]:  # the example uses ElasticTraining: both events run in place
        assert ev["mode"] == "in-place", ev["phases_s"]
        assert positive(ev["downtime_s"]) and positive(ev["detect_s"]) and ev["pause_s"] >= 0
        assert ev["steps_lost"] == 0
        assert {"scale_decided", "workers_signalled", "group_torn_down", "group_up", "hydrated", "first_step"} <= set(
            ev["phases_s"]
        )
    for ev in runs["torchrun-noshare"]["events"]:  # the baseline is recorded whatever it did
        assert ev["outcome"] in ("ok", "hang", "exited")
        if ev["outcome"] == "ok":
            assert positive(ev["downtime_s"]) and ev["steps_lost"] >= 0
    assert {"join", "yield"} <= set(data["summary"]["by_kind"])
    assert data["summary"]["hyperpodrun_modes"]["hyperpodrun"] == ["in-place", "in-place"]
    phases = data["summary"]["hyperpodrun_phases"]["hyperpodrun"]
    assert positive(phases["group_init_median_s"]) and positive(phases["to_first_step_median_s"])


# --------------------------------------------------------------------------- soak (pure parts)


def _rec(step: int, rank: int, world: int, ids: list[int]) -> dict[str, Any]:
    return {"step": step, "rank": rank, "world_size": world, "sample_ids": ids}


def _batches(step: int) -> list[int]:
    return [2 * step - 1, 2 * step]  # a global batch of 2: step 1 -> [1, 2], step 2 -> [3, 4], ...


@pytest.mark.parametrize(
    ("text", "expected"), [("45,65", (45, 65)), ("3,3", (3, 3)), ("9,4", None), ("0,4", None), ("x", None)]
)
def test_soak_gap_steps_option(bench: Any, text: str, expected: tuple[int, int] | None) -> None:
    soak = bench("soak")
    if expected is None:
        with pytest.raises(SystemExit, match="--gap-steps"):
            soak._gap_steps(text)
    else:
        assert soak._gap_steps(text) == expected


def test_soak_ledger_splits_attempts_and_allows_only_uncommitted_redo(bench: Any) -> None:
    ledger = bench("soak_ledger")
    log = [
        _rec(1, 0, 2, [1]),
        _rec(1, 1, 2, [2]),
        _rec(2, 0, 2, [3]),
        _rec(2, 1, 2, [4]),
        _rec(3, 0, 2, [5]),  # rank 1 died in step 3: the job restarts from the checkpoint of step 2
        _rec(3, 0, 1, [5, 6]),
        _rec(4, 0, 1, [7, 8]),
    ]
    by_step = ledger.attempts_of(log)
    assert [len(by_step[s]) for s in (1, 2, 3, 4)] == [1, 1, 2, 1]
    assert not by_step[3][0].complete and by_step[3][1].complete
    ok = ledger.check_window(by_step, first_line=4, end_line=99, graceful=False, committed=2, expected=_batches)
    assert ok.steps_redone == (3,) and ok.redone_committed == () and ok.problems == ()
    assert (ok.samples_lost, ok.samples_repeated, ok.samples_redone) == (0, 0, 2)
    stale = ledger.check_window(by_step, first_line=4, end_line=99, graceful=False, committed=3, expected=_batches)
    assert stale.redone_committed == (3,) and "checkpoint 3" in stale.problems[0]
    graceful = ledger.check_window(by_step, first_line=4, end_line=99, graceful=True, committed=2, expected=_batches)
    assert "graceful event redid steps [3]" in graceful.problems[0]
    assert ledger.missing_steps(by_step, 5) == [5]


def test_soak_ledger_reads_a_rank_lost_after_the_all_reduce_as_unlogged(bench: Any) -> None:
    """Rank 1 stopped after step 2's all-reduce and before its record, and was replaced in place: step 2
    lacks its record, yet rank 0's record proves the all-reduce (which needs both) ran. A failure may
    leave that; a graceful event may not; records that are not their ranks' share are a problem."""
    ledger = bench("soak_ledger")
    log = [
        _rec(1, 0, 2, [1]),
        _rec(1, 1, 2, [2]),
        _rec(2, 0, 2, [3]),
        _rec(3, 0, 2, [5]),
        _rec(3, 1, 2, [6]),
        _rec(4, 1, 2, [8]),
    ]
    by_step = ledger.attempts_of(log)
    failure = ledger.check_window(by_step, first_line=2, end_line=99, graceful=False, committed=0, expected=_batches)
    assert (
        failure.steps_unlogged == (2,) and failure.problems == () and failure.steps_redone == ()
    )  # step 4: still being logged
    graceful = ledger.check_window(by_step, first_line=2, end_line=99, graceful=True, committed=0, expected=_batches)
    assert graceful.problems == ("step 2: rank(s) [1] of a world of 2 left no record after a graceful event",)
    wrong = ledger.attempts_of(
        [_rec(2, 0, 2, [3, 4]), _rec(3, 0, 2, [5]), _rec(3, 1, 2, [6])]
    )  # rank 0 logged both halves
    bad = ledger.check_window(wrong, first_line=0, end_line=99, graceful=False, committed=0, expected=_batches)
    assert bad.steps_unlogged == (2,) and "not their share" in bad.problems[0]
    assert ledger.missing_steps(by_step, 4) == [2, 4]


def test_soak_ledger_puts_an_unlogged_step_in_the_window_of_the_failure_that_cost_its_record(bench: Any) -> None:
    """Rank 0 logged step 2, then rank 1 was killed before its record: the kill was injected after
    step 2's first line. The step is the kill's to explain (unlogged in the failure's window), not a
    problem of the graceful event before it."""
    ledger = bench("soak_ledger")
    log = [_rec(1, 0, 2, [1]), _rec(1, 1, 2, [2]), _rec(2, 0, 2, [3]), _rec(3, 0, 2, [5]), _rec(3, 1, 2, [6])]
    by_step = ledger.attempts_of(log)
    assert [by_step[s][-1].passed_line for s in (1, 2, 3)] == [2, 3, None]
    before = ledger.check_window(by_step, first_line=0, end_line=3, graceful=True, committed=0, expected=_batches)
    kill = ledger.check_window(by_step, first_line=3, end_line=99, graceful=False, committed=0, expected=_batches)
    assert before.problems == () and before.steps_unlogged == ()
    assert kill.steps_unlogged == (2,) and kill.problems == ()
    assert ledger.missing_steps(by_step, 3) == [2]


def test_soak_ledger_counts_lost_and_repeated_samples(bench: Any) -> None:
    ledger = bench("soak_ledger")
    by_step = ledger.attempts_of([_rec(1, 0, 2, [1]), _rec(1, 1, 2, [1]), _rec(2, 0, 1, [3, 4, 5])])
    check = ledger.check_window(by_step, first_line=0, end_line=9, graceful=True, committed=0, expected=_batches)
    assert (check.samples_lost, check.samples_repeated) == (1, 2)  # step 1: 2 lost, 1 twice; step 2: 5 extra
    assert len(check.problems) == 2 and check.steps_redone == ()
    assert (
        ledger.committed_step(
            [
                {"event": "checkpoint_saved", "ts": 5.0, "step": 10},
                {"event": "checkpoint_saved", "ts": 9.0, "step": 15},
            ],
            6.0,
        )
        == 10
    )
    assert ledger.goodput(90.0, 100.0) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="> 0"):
        ledger.goodput(0.0, 1.0)


@pytest.mark.parametrize("ranks", [1, 2])
def test_soak_deck_draws_every_eligible_kind_before_repeating(bench: Any, ranks: int) -> None:
    import random

    soak = bench("soak")
    kinds = bench("soak_ledger").KINDS
    state = soak.JobState.start(ranks)
    assert state.world == 3 * ranks
    assert not soak.eligible("join", state) and not soak.eligible("uncap", state)  # 3 nodes, no cap
    assert soak.eligible("leave", state) and soak.expected_world("yield", state) == 2 * ranks
    assert soak.expected_world("kill_rank", state) == 3 * ranks  # repaired at the same size
    assert not soak.eligible("leave", soak.JobState(ranks_per_node=ranks, nodes=1, world=ranks))
    deck = soak.Deck(kinds, random.Random(1))
    two = soak.JobState(ranks_per_node=ranks, nodes=2, world=2 * ranks)
    drawn = [deck.draw(two) for _ in range(len(kinds) - 1)]
    assert sorted(drawn) == sorted(set(kinds) - {"uncap"})  # uncap waits until a cap is set
    assert deck.draw(soak.JobState(ranks_per_node=ranks, nodes=3, world=2 * ranks, capped=True)) == "uncap"
    again = [soak.Deck(kinds, random.Random(1)).draw(soak.JobState.start(ranks)) for _ in range(3)]
    assert len(set(again)) == 1  # seeded: the same first draw every time


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_soak_smoke(out_dir: Path) -> None:
    """5 events (leave, join, kill -9 of a rank, etcd paused, etcd restarted) on 3 nodes of 2 ranks under etcd. Without the
    single-process run of the noise floor: that the example's deterministic reduction trains one process's bits
    at another world size is tests/examples/test_train.py's (test_deterministic_reduce_*)."""
    data = run_smoke("soak", out_dir, "--no-noise-floor")
    (path,) = data["params"]["paths"]
    s = data["summary"]["paths"][path]
    assert s["failure"] is None, s["failure"]
    assert s["job_deaths"] == 0 and s["events_total"] == 5 and s["events_survived"] == 5
    assert data["params"]["settings"]["ranks_per_node"] == 2
    assert s["siblings_kept"] == [1, 1]  # the killed rank's sibling trained on in place, as the same process
    assert sum(k["n"] for k in s["by_kind"].values()) == 5 and set(s["by_kind"]) <= set(data["params"]["kinds"])
    # Graceful events lose, repeat and redo nothing; failures redo only steps no checkpoint had committed.
    assert s["graceful_samples_lost"] == 0 and s["graceful_samples_repeated"] == 0 and s["graceful_steps_redone"] == 0
    assert s["committed_steps_redone"] == 0
    # Over the whole run every step was trained once by a full world on exactly its batch.
    run = data["samples"]["runs"][path]
    windows = [(ev["kind"], ev["sample_line"], ev["check"]) for ev in run["events"]]
    assert s["missing_steps_outside_failures"] == 0, f"missing steps {run['missing_steps']}; windows {windows}"
    assert s["final_samples_lost"] == 0 and s["final_samples_repeated"] == 0
    # Final parameters: the example's deterministic reduction trains the same bits at world 1, 2 and 3, so the
    # run with events ends exactly where the run without them does.
    assert data["params"]["settings"]["deterministic_reduce"] is True and data["params"]["noise_floor"] is False
    assert s["final_max_abs_diff"] == 0.0
    assert positive(s["goodput"]) and positive(data["summary"]["reference_time_to_steps_s"])
    for ev in data["samples"]["runs"][path]["events"]:
        assert ev["outcome"] == "ok" and ev["check"]["problems"] == [], ev
        if ev["kind"] in ("leave", "join", "etcd_pause", "etcd_restart"):
            assert ev["check"]["steps_redone"] == [], ev


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_framework_events_smoke(out_dir: Path) -> None:
    """One rank a node: each rank here costs seconds of framework imports; a two-rank node's join and leave with
    each framework are tests/integrations/test_framework_jobs.py's."""
    data = run_smoke("framework_events", out_dir, "--ranks-per-node", "1")
    runs = {r["variant"]: r for r in data["samples"]["runs"]}
    assert set(runs) == {"in-place", "restart"}
    assert data["params"]["ranks_per_node"] == 1
    for variant, run in runs.items():
        assert [(e["kind"], e["to_world"]) for e in run["events"]] == [("join", 2), ("leave", 1)]
        for ev in run["events"]:  # in place the survivor keeps its process; the restart path restarts it
            assert ev["mode"] == variant and ev["pid_kept"] is (variant == "in-place"), ev
            assert ev["steps_lost"] == 0 and positive(ev["downtime_s"])
    s = data["summary"]
    for kind in ("join", "leave"):
        assert s[f"{kind}_downtime_ratio_in_place_over_restart"] == pytest.approx(
            s[f"{kind}_in-place_downtime_s"] / s[f"{kind}_restart_downtime_s"]
        )


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_own_copy_smoke(out_dir: Path) -> None:
    """Every variant timed in each repetition, and every copy it took checked against the state of its step."""
    data = run_smoke("own_copy", out_dir)
    s, samples = data["summary"], data["samples"]
    assert samples["copies_checked"] == 2 * data["params"]["reps"] == s["copies_checked"]  # at_seal, overlapped
    assert all(len(samples["step_s"][v]) == data["params"]["reps"] for v in ("none", "at_seal", "overlapped"))
    assert all(positive(ms) for ms in s["step_ms"].values())
    for key in ("at_seal_over_none", "overlapped_over_none", "overlapped_over_at_seal"):
        ci = s[key]
        assert ci["n"] == 2 and positive(ci["ratio"]) and ci["ci_low"] <= ci["ratio"] <= ci["ci_high"], (key, ci)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_new_mesh_step_smoke(out_dir: Path) -> None:
    """Both clips on a fresh mesh in every repetition, the warm-up left out, their gradient norms in agreement."""
    data = run_smoke("new_mesh_step", out_dir, "--world", "2", "--replicas", "2")
    s, records = data["summary"], data["samples"]["records"]
    reps = data["params"]["reps"]
    assert sorted((r["rep"], r["variant"]) for r in records) == sorted(
        (rep, v) for rep in range(reps) for v in ("torch", "local")
    )
    assert all(
        len(r["steady_s"]) == data["params"]["steps"] and len(r["norms"]) == 1 + data["params"]["steps"]
        for r in records
    )
    assert s["reps_counted"] == reps - 1
    for figure in ("first_step", "steady_step"):
        ci = s[f"{figure}_local_over_torch"]
        assert ci["n"] == reps - 1 and positive(ci["ratio"]) and ci["ci_low"] <= ci["ratio"] <= ci["ci_high"], ci
        assert all(positive(s[f"{v}_{figure}_s"]) for v in ("torch", "local"))
