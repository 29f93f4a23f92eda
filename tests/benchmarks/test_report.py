"""``benchmarks/report.py``: the READMEs' figures rendered from the benchmarks' summary files.

Rendering is checked on fixture summaries (``fixtures/summary/``, values chosen for the test),
and the committed READMEs against the committed summaries in ``benchmarks/results/summary/``.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "summary"


@pytest.fixture(scope="module")
def report(bench) -> ModuleType:
    return bench("report")


def test_load_prefers_the_most_thorough_mode_then_the_newest(report: ModuleType) -> None:
    docs = report.load_summaries(FIXTURES)
    assert sorted(docs) == sorted([*report.EXPECTED, "new_thing"])
    # scale_events_smoke.json is newer, but the quick run is the more thorough one
    assert docs["scale_events"]["mode"] == "quick" and docs["scale_events"]["_file"] == "scale_events_quick.json"
    assert docs["failures_fsdp"]["tag"] == "fsdp"


def test_a_missing_summary_keeps_its_section_and_says_how_to_produce_it(report: ModuleType, tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "hydration_quick.json", tmp_path)
    lines = report.render_figures(report.load_summaries(tmp_path)).splitlines()
    assert [line for line in lines if line.startswith("### ")] == [f"### Latest: {key}" for key in report.EXPECTED]
    assert "No summary file: `python benchmarks/failures.py --quick` writes it." in lines
    assert sum(line.startswith("No summary file") for line in lines) == len(report.EXPECTED) - 1


def test_load_names_a_file_that_is_not_a_summary(report: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text(json.dumps({"benchmark": "x"}))
    with pytest.raises(report.ReportError, match="broken.json: not a benchmark summary"):
        report.load_summaries(tmp_path)


def test_figures_show_ratios_first_then_each_variant(report: ModuleType) -> None:
    text = report.render_figures(report.load_summaries(FIXTURES))
    lines = text.splitlines()
    sections = [line.removeprefix("### Latest: ") for line in lines if line.startswith("### ")]
    # every expected section, in order, then the summary of a benchmark the script does not know
    assert sections == [*report.EXPECTED, "new_thing"]
    assert (
        "`python benchmarks/scale_events.py --quick` · quick · 2026-11-23 · commit `728e54e` · 5 min · "
        "load 0.2 at the start, 1.1 at the end on 2 CPUs · "
        "[`scale_events_quick.json`](results/summary/scale_events_quick.json)"
    ) in lines
    assert (
        "| event (n) | in place / torchrun-noshare: downtime | lost time | in place (default) | "
        "restart path (`--restart-mode process`) | torchrun (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`) |"
    ) in lines
    assert (
        "| join (2) | 0.14 | 0.016 | 0.59 s (pause 0.091 s), 0 lost, 2/2 in place | 3.05 s, 0 lost | 4.25 s, 3 lost |"
    ) in lines
    assert (
        "| rejoin (1) | 0.16 | 0.016 | 0.59 s (pause 0.089 s), 0 lost, 1/1 in place | 3.37 s, 0 lost | 3.60 s, 4 lost |"
        in lines
    )
    assert "In place, medians: teardown 0.030 s, group init 0.012 s, hydration 0.021 s, first step 0.51 s." in lines
    # failures: a fallback to a restart shows in the count; the hang has no torchrun row and no ratio
    assert (
        "| node_loss (4) | 0.16 | 0.12 | 1.40 s, 0 lost, 3/4 in place | 7.30 s, 6 lost | 8.88 s, 6 lost | 0.34 s |"
    ) in lines
    assert "| hang (4) | – | – | 7.03 s, 0 lost, 4/4 in place | 14.6 s, 2 lost | – | 5.05 s |" in lines
    assert "A new node joining after a node loss: in place (default) 0.59 s, 0 lost." in lines
    assert (
        "In place, medians of seconds from the failure to each record: rank_crash scale_decided 0.090, group_up 0.89, "
        "hydrated 0.93, first_step 1.47."
    ) in lines
    # a busy run and local changes are said where the run is named
    fsdp = next(line for line in lines if line.startswith("`python benchmarks/failures.py --quick --train-args"))
    assert "commit `3a9a256` + local changes to src/elastic_events/x.py ·" in fsdp  # report.py's change is not shown
    assert "load 4.5 at the start, 5.2 at the end on 2 CPUs: **busy, expect noisy timings**" in fsdp
    assert "| join (1 → 2 nodes of 2) | 0.063 | 0.51 s, survivor kept its process | 8.15 s |" in lines
    assert "| CPU time per step, torchrun / hyperpodrun | 1.005, 95 % CI 0.979 – 1.032 (10 pairs) |" in lines
    assert (
        "| `elastic_event_detected()` under hyperpodrun, median | 0.26 µs (p99 0.31 µs; outside a launcher 0.06 µs; "
        "the timer 0.05 µs) |"
    ) in lines
    assert "| per step, hyperpodrun / torchrun | 0.48 s / 0.48 s wall, 0.95 s / 0.95 s CPU |" in lines
    assert "| in place | 0.812 | 5 / 5 | 0 | 0 / 0 | 0 | 0 (bit for bit) |" in lines
    assert "| kill_rank | 0.86 s (1), 0 redone | 11.9 s (1), 4 redone |" in lines
    # a benchmark the script does not know: its scalar figures, nothing nested
    assert "| speedup | 1.235 |" in lines and "| label | x |" in lines
    assert not any("nested" in line for line in lines)


def test_event_costs_name_the_ranks_a_node_held_and_a_run_that_held_other_counts(report: ModuleType) -> None:
    docs = report.load_summaries(FIXTURES)
    for name in ("scale_events", "failures"):
        docs[name]["params"]["timers"]["nproc_per_node"] = 2
    intro = report.render_event_costs(docs).splitlines()[0]
    assert "(tiny model, nodes of 2 ranks, gloo, " in intro
    assert "with `--train-args=--fsdp` for the sharded row (nodes of 1 rank), " in intro  # its summary says none
    docs["failures_fsdp"]["params"]["timers"]["nproc_per_node"] = 2
    assert "for the sharded row, " in report.render_event_costs(docs).splitlines()[0]


def test_event_costs_rows_come_from_the_summaries(report: ModuleType) -> None:
    lines = report.render_event_costs(report.load_summaries(FIXTURES)).splitlines()
    intro = lines[0]
    assert intro.startswith(
        "Measured by [`benchmarks/`](benchmarks/README.md) on a 2-core CPU machine (tiny model, nodes of 1 rank, gloo, "
    )
    assert "0.5 s steps, a checkpoint every 10 steps" in intro
    assert "`scale_events.py --quick`, 2026-11-23, commit `728e54e`, load 0.2 – 1.1 on 2 CPUs" in intro
    assert "`failures.py --quick` (4 of each failure), 2026-11-25, commit `99c3e80`" in intro
    assert (
        "2026-11-26, commit `3a9a256` + local changes to src/elastic_events/x.py, load 4.5 – 5.2 on 2 CPUs, busy"
        in intro
    )
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines if line.startswith("| ")}
    assert rows["a node joins"] == (
        "| a node joins | downtime 0.59 s (the survivors paused 0.091 s), **0 steps lost** | 3.05 s, 0 steps lost "
        "| 4.25 s, 3 steps lost |"
    )
    assert rows["`hyperpodctl yield 1` / `uncap`"] == (
        "| `hyperpodctl yield 1` / `uncap` | 0.62 s / 0.59 s, **0 steps lost** | 2.97 s / 3.37 s, 0 steps lost "
        "| (no such operation) |"
    )
    assert (
        "1.40 s, **0 steps lost** (1 of 4 restarted) | 7.30 s, 6 steps lost | 8.88 s, 6 steps lost |"
        in (rows["a node is lost (kill -9 of its launcher and ranks)"])
    )
    assert (
        "7.03 s, **0 steps lost**, found after 5.05 s | 14.6 s, 2 steps lost | not detected |"
        in (rows["a rank hangs (SIGSTOP, `--hang-timeout 5`)"])
    )
    assert rows["a rank crashes / a node is lost, **sharded (FSDP2) model**"].endswith(
        "1.08 s / 1.43 s, **1 step lost** | 7.38 s / 6.46 s, 4 / 7 steps lost | 5.00 s / 6.70 s, 4 / 7 steps lost |"
    )
    assert rows["etcd restarted, or paused for seconds"] == (
        "| etcd restarted, or paused for seconds | training does not stop, **0 steps lost** (1 of 1 events survived) "
        "| – | – |"
    )
    assert "`soak.py --smoke` for etcd, 2026-11-20, commit `abc1234`" in intro
    assert lines[2].endswith("| torchrun (no shared store), same run |")
    assert (
        "a join cost 0.51 s against 8.15 s on the restart path in the same run, a leave 0.66 s against 7.70 s"
        in (lines[-1])
    )


def _readmes(tmp_path: Path) -> tuple[Path, Path]:
    bench = tmp_path / "bench.md"
    main = tmp_path / "main.md"
    bench.write_text("# B\n\nprose\n\n<!-- latest-figures:begin -->\nold\n<!-- latest-figures:end -->\n\ntail\n")
    main.write_text("# M\n<!-- event-costs:begin -->\n<!-- event-costs:end -->\nend\n")
    return bench, main


def test_main_rewrites_between_the_markers_and_check_finds_staleness(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summaries = tmp_path / "summary"
    shutil.copytree(FIXTURES, summaries)
    bench, main = _readmes(tmp_path)
    argv = ["--summaries", str(summaries), "--bench-readme", str(bench), "--main-readme", str(main)]
    assert report.main([*argv, "--check"]) == 1
    assert "bench.md is out of date" in capsys.readouterr().err
    assert report.main(argv) == 0
    text = bench.read_text()
    assert text.startswith("# B\n\nprose\n\n<!-- latest-figures:begin -->\n<!-- generated by benchmarks/report.py")
    assert text.endswith("<!-- latest-figures:end -->\n\ntail\n") and "\nold\n" not in text
    assert "| join (2) | 0.14 | 0.016 |" in text and "| a node joins | downtime 0.59 s" in main.read_text()
    assert report.main([*argv, "--check"]) == 0
    assert report.main(argv) == 0 and bench.read_text() == text  # rendering is stable
    # a new result makes the committed text stale
    doc = json.loads((summaries / "framework_events_quick.json").read_text())
    doc["summary"]["join_in-place_downtime_s"] = 0.42
    (summaries / "framework_events_quick.json").write_text(json.dumps(doc))
    assert report.main([*argv, "--check"]) == 1
    assert report.main(argv) == 0 and "0.42 s, survivor kept its process" in bench.read_text()


def test_main_refuses_a_readme_without_its_markers(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench, main = _readmes(tmp_path)
    main.write_text("# M\nno markers\n")
    argv = ["--summaries", str(FIXTURES), "--bench-readme", str(bench), "--main-readme", str(main)]
    assert report.main(argv) == 2
    assert "expected one <!-- event-costs:begin --> and one <!-- event-costs:end --> line" in capsys.readouterr().err
    assert main.read_text() == "# M\nno markers\n"


def test_committed_readmes_match_the_committed_summaries(report: ModuleType) -> None:
    rendered = report.render_files(report.SUMMARY_DIR, report.BENCH_README, report.MAIN_README)
    for path, text in rendered.items():
        assert path.read_text() == text, f"{path} is out of date: run python benchmarks/report.py"
    assert sorted(report.SUMMARY_DIR.glob("*.json")), "no committed summary files"


def test_the_smaller_benchmarks_render_their_ratio_first(report: ModuleType) -> None:
    lines = report.render_figures(report.load_summaries(FIXTURES)).splitlines()
    assert (
        "Optimizer steps/s with `ElasticCallback` under hyperpodrun / without it under torchrun: **1.005** "
        "(paired runs 0.940 – 1.070; target ≥ 0.99): 94.6 against 94.1 steps/s."
    ) in lines
    assert (
        "Throughput with snapshots / without: **0.981** (target ≥ 0.97); by pairs 0.973, 95 % CI 0.941 – 1.007 "
        "(10 pairs); CPU per step 0.972, 95 % CI 0.950 – 0.990 (10 pairs). Median step 0.97 s against 0.96 s, CPU per "
        "step 1.83 s against 1.78 s. Snapshot memory **3.00x** the local state (52.0 MB per rank). Snapshots every "
        "step (`--snapshot-every 1`)."
    ) in lines
    assert (
        "Hydration / broadcast of the same bytes: **0.94** (per repetition 0.83 – 1.06; target ≥ 0.5): 1085 against "
        "1156 MB/s, 72 MB of state, 2 ranks."
    ) in lines
    assert (
        "DCP's time over ours, same processes: gather **2.40x**, load **3.52x** (930 MB of state, 81 M parameters, "
        "4 gloo ranks): gather 1.07 s against 2.57 s, load 0.64 s against 2.24 s."
    ) in lines
    assert "| example-tiny | 0.22 | 0.20 | 35 MB | 0.17 / 0.78 GB/s | 0.21 / 1.04 GB/s |" in lines
    assert (
        "Resharded load (FSDP2, saved by 2 ranks, loaded by 1) / same-size load: 1.53 (0.26 s against 0.17 s; "
        "save at 2 ranks 0.18 s)."
    ) in lines
    assert "| 8 | 0.20 s | 13.8 | 0.020 s | 13.8 |" in lines and "| 64 | 0.95 s | 13.2 | – | – |" in lines
    assert (
        "Growth against the smallest N: etcd: time ~ N^0.75, ops per node ~ N^-0.02; embedded: time ~ N^–, "
        "ops per node ~ N^–, failed at N = [64]."
    ) in lines
    assert "| 1 | 1.00 | 1.00 | 2449 |" in lines and "| 4 (oversubscribed) | 0.44 | 1.76 | 4320 |" in lines
    assert (
        "HSDP's copy one step back, 2048 MB of state on Test GPU: a step with the copy after the optimizer step "
        "(the product's) / without a copy **1.01 (95 % CI 1.00 – 1.02)**; with the copy in the pre-step hook / "
        "without 1.40 (95 % CI 1.38 – 1.42); 100 / 101.50 / 140 ms a step; 10 copies checked against the state of "
        "their step."
    ) in lines
    assert (
        "The first step on a mesh new to the process (2 replica(s) x 2 shard(s), the tiny model), gradient clip from "
        "the local shards / torch's clip: **0.538, 95 % CI 0.467 – 0.620 (6 pairs)**; a steady step 1.063, 95 % CI "
        "0.991 – 1.141 (6 pairs). Medians: first step 1.68 s with torch's clip, 0.85 s from the local shards; steady "
        "step 0.38 / 0.39 s."
    ) in lines


def test_the_snapshot_figure_names_the_intervals_auto_chose(report: ModuleType) -> None:
    figures = importlib.import_module("report_figures")
    summary = {"snapshot_every": "auto", "chosen_intervals": [4, 6], "chosen_overheads": [0.015, 0.019]}
    (line,) = figures.render_step_overhead_snapshot({"summary": summary})
    assert line.endswith("`--snapshot-every auto` chose every 4, 6 step(s) (expected overhead at most 1.90%).")


def test_state_scaling_renders_a_row_per_size_and_says_what_failed(report: ModuleType) -> None:
    lines = report.render_figures(report.load_summaries(FIXTURES)).splitlines()
    assert (
        "| tiny | 2.9M | 12 MB | every 20 (1.9% of a step) | 0.080 s (108 MB/s) | 42.6 (15.9) | 0.21 s (to 6 ranks) | "
        "0.12 s | 1.45 s, 3 redone (every 20) | 1.90 s, 1 redone (every 20) | 0.43 / 0.54 | 0.970 |"
    ) in lines
    assert "| llama-125m | 125.3M | 501 MB | every 9 (1.8% of a step) |" in next(
        line for line in lines if line.startswith("| llama-125m")
    )
    assert "skipped (memory)" in next(line for line in lines if line.startswith("| llama-125m"))
    assert (
        "Repairs that found no complete snapshot (state from the checkpoint, or a fresh model): llama-125m rank "
        "crash: no snapshot: no step at which every shard survived."
    ) in lines
    assert "Stopped early: llama-125m: hyperpodrun: 2 steps after the node_loss did not happen within 180s." in lines


def test_start_method_renders_each_figure_as_a_paired_ratio(report: ModuleType) -> None:
    lines = report.render_figures(report.load_summaries(FIXTURES)).splitlines()
    assert (
        "| rank killed to first step after the restart | 2.84 s | 1.02 s | 0.34, 95 % CI 0.32 – 0.36 (5 pairs) |"
    ) in lines
