"""Render the benchmarks' latest figures into the READMEs from the summary files.

Every benchmark writes ``benchmarks/results/summary/<name>[_<tag>]_<mode>.json`` (kept in git).
This script reads them and rewrites the text between two marker comments:

* ``benchmarks/README.md``, ``<!-- latest-figures:begin -->`` … ``end``: a section per expected
  summary (:data:`EXPECTED`, then any other), each naming its run (command, mode, date, commit,
  duration, the machine's load) with a compact table or sentence, the ratios against the baseline
  measured in the same run first;
* ``README.md``, ``<!-- event-costs:begin -->`` … ``end``: the "What each event costs" table, from
  the scale_events, failures (replicated and ``fsdp``), soak and framework_events summaries.

Per benchmark and tag the most thorough mode present is shown (full, then quick, then smoke), the
newest run of that mode if there are several::

    python benchmarks/report.py            # rewrite the blocks
    python benchmarks/report.py --check    # exit 1 when a block differs from what the summaries give
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SUMMARY_DIR = REPO_ROOT / "benchmarks" / "results" / "summary"
BENCH_README = REPO_ROOT / "benchmarks" / "README.md"
MAIN_README = REPO_ROOT / "README.md"
FIGURES = "latest-figures"
EVENT_COSTS = "event-costs"
MODE_RANK = {"full": 3, "quick": 2, "smoke": 1}
#: The sections, in order, and the command that produces each one's summary (``make bench`` runs them all);
#: a section without a summary file says so, and a summary of another benchmark or tag follows, rendered
#: generically when this script has no renderer for it.
EXPECTED = {
    "scale_events": "python benchmarks/scale_events.py --quick",
    "failures": "python benchmarks/failures.py --quick",
    "failures_fsdp": "python benchmarks/failures.py --quick --train-args=--fsdp --kinds rank_crash,node_loss",
    "framework_events": "python benchmarks/framework_events.py --quick",
    "step_overhead": "python benchmarks/step_overhead.py --quick",
    "step_overhead_hf": "python benchmarks/step_overhead.py --quick --client hf",
    "step_overhead_snapshot": "python benchmarks/step_overhead.py --quick --client snapshot",
    "hydration": "python benchmarks/hydration.py --quick",
    "checkpoint": "python benchmarks/checkpoint.py --quick",
    "rendezvous_scale": "python benchmarks/rendezvous_scale.py --quick",
    "throughput": "python benchmarks/throughput.py --quick",
    "soak": "python benchmarks/soak.py --smoke --paths in-process,process",
}
DASH = "–"

Summary = dict[str, Any]


class ReportError(RuntimeError):
    """The READMEs or the summaries are not as this script expects (a missing marker, a bad file)."""


# --------------------------------------------------------------------------- loading


def load_summaries(directory: Path) -> dict[str, Summary]:
    """The summary to show per ``<benchmark>[_<tag>]``: the most thorough mode, then the newest run."""
    chosen: dict[str, Summary] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
            key = doc["benchmark"] + (f"_{doc['tag']}" if doc.get("tag") else "")
            rank = (MODE_RANK[doc["mode"]], doc["finished_at"])
        except (ValueError, KeyError, TypeError) as e:
            raise ReportError(f"{path}: not a benchmark summary ({e})") from None
        doc["_file"] = path.name
        old = chosen.get(key)
        if old is None or rank > (MODE_RANK[old["mode"]], old["finished_at"]):
            chosen[key] = doc
    return chosen


# --------------------------------------------------------------------------- formatting


def sec(x: float | None, unit: str = " s") -> str:
    """Seconds to 3 significant figures (at least 2 decimals below 10, 3 below 0.1)."""
    if x is None:
        return DASH
    if abs(x) >= 100:
        return f"{x:.0f}{unit}"
    if abs(x) >= 10:
        return f"{x:.1f}{unit}"
    if abs(x) >= 0.1:
        return f"{x:.2f}{unit}"
    return f"{x:.3f}{unit}"


def num(x: float | None, digits: int = 2) -> str:
    """A ratio or plain figure with ``digits`` decimals; a whole number without any."""
    if x is None:
        return DASH
    if float(x).is_integer() and abs(x) >= 1:
        return str(int(x))
    return f"{x:.{digits}f}"


def ratio(x: float | None) -> str:
    """A ratio to 2 decimals, or to 2 significant figures below 0.1 (``0.0046``, not ``0.00``)."""
    if x is None:
        return DASH
    return f"{x:.2g}" if abs(x) < 0.1 else f"{x:.2f}"


def steps(x: float | None) -> str:
    if x is None:
        return DASH
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def steps_lost(*values: float | None) -> str:
    """``0 steps lost``, ``1 step lost``, ``4 / 7 steps lost``: one figure when all are equal."""
    shown = [steps(v) for v in values]
    if len(set(shown)) == 1:
        shown = shown[:1]
    return " / ".join(shown) + (" step lost" if shown == ["1"] else " steps lost")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def dig(doc: Mapping[str, Any], *keys: str) -> Any:
    """``doc[k1][k2]…``, or None where a level is missing."""
    value: Any = doc
    for key in keys:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def load_note(doc: Summary, *, short: bool = False) -> str:
    """The 1-minute load at the start and the end against the usable CPUs (``short``: ``load 0.2 – 1.1 on 2 CPUs``)."""
    m = doc.get("machine") or {}
    start, end, cpus = m.get("loadavg_1m"), m.get("loadavg_1m_end"), m.get("usable_cpus")
    if start is None:
        return "load not recorded"
    end = start if end is None else end
    on = f" on {cpus} CPUs" if cpus else ""
    if short:
        return f"load {start:.1f} – {end:.1f}{on}" + (", busy" if max(start, end) > (cpus or 0) else "")
    busy = ": **busy, expect noisy timings**" if max(start, end) > (cpus or 0) else ""
    return f"load {start:.1f} at the start, {end:.1f} at the end{on}{busy}"


def provenance(doc: Summary) -> str:
    """One line: command, date, commit (with local changes if any), duration and load."""
    versions = doc.get("versions") or {}
    commit = versions.get("git_commit") or "unknown commit"
    dirty = versions.get("git_dirty")
    changes = f" + local changes to {', '.join(dirty)}" if dirty else ""
    minutes = (doc.get("duration_s") or 0) / 60
    command = doc.get("command") or f"{doc['benchmark']} --{doc['mode']}"
    return (
        f"`{command}` · {doc['mode']} · {doc['started_at'][:10]} · commit `{commit}`{changes} · "
        f"{minutes:.0f} min · {load_note(doc)} · [`{doc['_file']}`](results/summary/{doc['_file']})"
    )


# --------------------------------------------------------------------------- scale events and failures

OURS, RESTART = "hyperpodrun", "hyperpodrun-restart"
TORCHRUN_LABEL = {"torchrun-noshare": "torchrun (no shared store)", "torchrun": "torchrun as shipped"}
TORCHRUNS = ("torchrun-noshare", "torchrun")
VARIANT_LABEL = {
    OURS: "in place (default)",
    RESTART: "restart path (`--restart-mode process`)",
    "torchrun-noshare": "torchrun (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`)",
    "torchrun": "torchrun as shipped",
}


def baseline_of(doc: Summary) -> str | None:
    """The torchrun variant the ratios are taken against: without the shared store when it ran."""
    ratios = dig(doc, "summary", "downtime_ratio", OURS) or {}
    by_kind = dig(doc, "summary", "by_kind") or {}
    ran = {v for kinds in by_kind.values() for v in kinds}
    return next((v for v in TORCHRUNS if v in ratios or v in ran), None)


def event(stats: Mapping[str, Any] | None, *, pause: bool = False, mode: bool = False) -> str:
    """``downtime (pause), steps lost`` of one variant and kind; failures show their outcomes."""
    if not stats:
        return DASH
    if stats.get("ok", 0) == 0:
        return "did not recover (" + ", ".join(sorted(set(stats.get("outcomes") or []))) + ")"
    text = sec(stats.get("downtime_median_s"))
    if pause and stats.get("pause_median_s") is not None:
        text += f" (pause {sec(stats['pause_median_s'])})"
    text += f", {steps(stats.get('steps_lost_median'))} lost"
    if mode:
        modes = stats.get("modes") or []
        text += f", {modes.count('in-place')}/{stats['n']} in place"
    if stats["ok"] < stats["n"]:
        text += f" ({stats['n'] - stats['ok']} of {stats['n']} did not recover)"
    return text


def event_table(doc: Summary, kinds: Sequence[str], *, pause: bool, detect: bool) -> list[str]:
    s = doc["summary"]
    base = baseline_of(doc)
    variants = [v for v in (OURS, RESTART, *TORCHRUNS) if any(v in (s["by_kind"].get(k) or {}) for k in kinds)]
    headers = ["event (n)"]
    if base:
        headers += [f"in place / {base}: downtime", "lost time"]
    headers += [VARIANT_LABEL[v] for v in variants]
    if detect:
        headers.append("time to detect, in place")
    rows = []
    for kind in [k for k in kinds if k in s["by_kind"]]:
        by_variant = s["by_kind"][kind]
        n = by_variant.get(OURS, next(iter(by_variant.values())))["n"]
        row = [f"{kind} ({n})"]
        if base:
            row += [
                ratio(dig(s, "downtime_ratio", OURS, base, kind)),
                ratio(dig(s, "lost_time_ratio", OURS, base, kind)),
            ]
        row += [event(by_variant.get(v), pause=pause and v == OURS, mode=v == OURS) for v in variants]
        if detect:
            row.append(sec(dig(by_variant, OURS, "detect_median_s")))
        rows.append(row)
    return table(headers, rows)


SCALE_KINDS = ("join", "leave", "yield", "rejoin")
FAILURE_KINDS = ("rank_crash", "hang", "node_loss")


def render_scale_events(doc: Summary) -> list[str]:
    s = doc["summary"]
    extra = [k for k in s["by_kind"] if k not in SCALE_KINDS]
    lines = event_table(doc, [*SCALE_KINDS, *extra], pause=True, detect=False)
    phases = dig(s, "hyperpodrun_phases", OURS) or {}
    spans = [
        (label, phases.get(key))
        for label, key in (
            ("teardown", "teardown_median_s"),
            ("group init", "group_init_median_s"),
            ("hydration", "hydration_median_s"),
            ("first step", "to_first_step_median_s"),
        )
    ]
    if any(v is not None for _, v in spans):
        lines += ["", "In place, medians: " + ", ".join(f"{label} {sec(v)}" for label, v in spans) + "."]
    restart = dig(s, "hyperpodrun_phases", RESTART) or {}
    if restart:
        lines.append(
            "Restart path, medians: "
            + ", ".join(
                f"{label} {sec(restart.get(key))}"
                for label, key in (
                    ("save", "save_median_s"),
                    ("exit after save", "exit_after_save_median_s"),
                    ("restart to first step", "restart_median_s"),
                )
            )
            + "."
        )
    ft = s.get("torchft")
    if ft:
        pauses = ", ".join(f"{k} {sec(dig(ft, k, 'pause_median_s'))}" for k in ("join", "leave") if ft.get(k))
        lines.append(
            f"torchft survivors' pause, medians: {pauses or DASH}"
            + (" (stopped early)" if ft.get("failure") else "")
            + "."
        )
    return lines


def render_failures(doc: Summary) -> list[str]:
    s = doc["summary"]
    lines = event_table(doc, FAILURE_KINDS, pause=False, detect=True)
    rejoin = s.get("rejoin_after_node_loss") or {}
    if rejoin:
        lines += [
            "",
            "A new node joining after a node loss: "
            + "; ".join(
                f"{VARIANT_LABEL.get(v, v)} {sec(r.get('downtime_median_s'))}, {steps(r.get('steps_lost_median'))} lost"
                for v, r in rejoin.items()
            )
            + ".",
        ]
    phases = dig(s, "phases_from_failure_median_s", OURS) or {}
    records = ("scale_decided", "group_torn_down", "group_up", "snapshot_restored", "hydrated", "first_step")
    by_kind = [
        f"{kind} " + ", ".join(f"{k} {sec(phases[kind][k], '')}" for k in records if phases[kind].get(k) is not None)
        for kind in FAILURE_KINDS
        if phases.get(kind)
    ]
    if by_kind:
        lines.append("In place, medians of seconds from the failure to each record: " + "; ".join(by_kind) + ".")
    deaths = {v: d for v, d in (s.get("job_deaths") or {}).items() if d}
    if deaths:
        lines.append("Job stopped early: " + ", ".join(deaths) + ".")
    return lines


# --------------------------------------------------------------------------- the other benchmarks


def ci_text(ci: Mapping[str, Any] | None, digits: int = 3) -> str:
    if not ci:
        return DASH
    return f"{ci['ratio']:.{digits}f}, 95 % CI {ci['ci_low']:.{digits}f} – {ci['ci_high']:.{digits}f} ({ci['n']} pairs)"


def render_framework_events(doc: Summary) -> list[str]:
    s = doc["summary"]
    rows = []
    for kind, label in (("join", "join (1 → 2)"), ("leave", "leave (2 → 1)")):
        if f"{kind}_in-place_downtime_s" not in s:
            continue
        kept = "kept its process" if s.get(f"{kind}_in-place_survivor_kept_process") else "restarted"
        rows.append(
            [
                label,
                ratio(s.get(f"{kind}_downtime_ratio_in_place_over_restart")),
                f"{sec(s[f'{kind}_in-place_downtime_s'])}, survivor {kept}",
                sec(s.get(f"{kind}_restart_downtime_s")),
            ]
        )
    return table(["event", "in place / restart path", "in place", "restart path"], rows)


def render_step_overhead(doc: Summary) -> list[str]:
    s = doc["summary"]
    hyp, tor = "hyperpodrun", "torchrun"
    rows = [
        ["CPU time per step, torchrun / hyperpodrun", ci_text(s.get("cpu_step_ratio_ci"))],
        ["wall time per step, torchrun / hyperpodrun", ci_text(s.get("wall_step_ratio_ci"))],
        [
            "tokens/s end to end, hyperpodrun / torchrun",
            f"{num(s.get('throughput_ratio'), 3)} (runs {num(s.get('throughput_ratio_paired_min'), 3)} – "
            f"{num(s.get('throughput_ratio_paired_max'), 3)})",
        ],
        [
            "`elastic_event_detected()` under hyperpodrun, median",
            f"{num(s.get('check_inside_median_us'))} µs (p99 {num(s.get('check_inside_p99_us'))} µs; outside a "
            f"launcher {num(s.get('check_outside_median_us'))} µs; the timer {num(s.get('timer_floor_median_us'))} µs)",
        ],
        [
            "one-element `all_reduce`, gloo, median",
            f"{num(s.get('allreduce_gloo_median_us'), 0)} µs (p99 {num(s.get('allreduce_gloo_p99_us'), 0)} µs)"
            + (f"; NCCL {num(s['allreduce_nccl_median_us'])} µs" if s.get("allreduce_nccl_median_us") else ""),
        ],
        [
            "per step, hyperpodrun / torchrun",
            f"{sec(s.get(f'{hyp}_median_step_s'))} / {sec(s.get(f'{tor}_median_step_s'))} wall, "
            f"{sec(s.get(f'{hyp}_cpu_per_step_s'))} / {sec(s.get(f'{tor}_cpu_per_step_s'))} CPU",
        ],
        [
            "launcher's own CPU, hyperpodrun / torchrun",
            f"{num(s.get(f'{hyp}_agent_cpu_fraction'))} / {num(s.get(f'{tor}_agent_cpu_fraction'))} of a core",
        ],
    ]
    return table(["measure", f"value (target ≥ {s.get('throughput_target', 0.99)} for the ratios)"], rows)


def render_step_overhead_hf(doc: Summary) -> list[str]:
    s = doc["summary"]
    return [
        f"Optimizer steps/s with `ElasticCallback` under hyperpodrun / without it under torchrun: "
        f"**{num(s.get('throughput_ratio'), 3)}** (paired runs {num(s.get('throughput_ratio_paired_min'), 3)} – "
        f"{num(s.get('throughput_ratio_paired_max'), 3)}; target ≥ {s.get('throughput_target', 0.99)}): "
        f"{num(s.get('hyperpodrun_callback_steps_per_s'), 1)} against {num(s.get('torchrun_steps_per_s'), 1)} steps/s."
    ]


def render_step_overhead_snapshot(doc: Summary) -> list[str]:
    s = doc["summary"]
    step, cpu = s.get("median_step_s") or {}, s.get("cpu_per_step_s") or {}
    held = (s.get("snapshot_bytes_per_rank") or 0) / 1e6
    memory = DASH if s.get("memory_ratio") is None else f"{s['memory_ratio']:.2f}x"
    return [
        f"Throughput with snapshots / without: **{num(s.get('throughput_ratio'), 3)}** (target ≥ "
        f"{s.get('target_throughput_ratio', 0.97)}); by pairs {ci_text(s.get('wall_step_ratio_ci'))}; CPU per step "
        f"{ci_text(s.get('cpu_step_ratio_ci'))}. Median step {sec(step.get('snapshots'))} against "
        f"{sec(step.get('no-snapshots'))}, CPU per step {sec(cpu.get('snapshots'))} against "
        f"{sec(cpu.get('no-snapshots'))}. Snapshot memory **{memory}** the local state ({held:.1f} MB per rank)."
    ]


def render_hydration(doc: Summary) -> list[str]:
    s = doc["summary"]
    ranks = dig(doc, "params", "ranks")
    return [
        f"Hydration / broadcast of the same bytes: **{num(s.get('ratio_to_broadcast'))}** (per repetition "
        f"{num(s.get('ratio_per_rep_min'))} – {num(s.get('ratio_per_rep_max'))}; target ≥ 0.5): "
        f"{num(s.get('hydration_mb_per_s'), 0)} against {num(s.get('broadcast_mb_per_s'), 0)} MB/s, "
        f"{num(s.get('state_mb'), 0)} MB of state, {ranks} ranks."
    ]


def render_checkpoint(doc: Summary) -> list[str]:
    s = doc["summary"]
    rows = []
    for state, v in s.items():
        if state == "reshard" or not isinstance(v, Mapping):
            continue
        rows.append(
            [
                state,
                num(v.get("save_fraction_of_disk")),
                num(v.get("load_cold_fraction_of_disk")),
                f"{(v.get('bytes') or 0) / 1e6:.0f} MB",
                f"{num(v.get('dcp_save_gbps'))} / {num(v.get('raw_write_gbps'))} GB/s",
                f"{num(v.get('dcp_load_cold_gbps'))} / {num(v.get('raw_read_cold_gbps'))} GB/s",
            ]
        )
    lines = table(
        ["state", "DCP save / disk", "DCP load / disk (cold)", "bytes", "save: DCP / raw", "cold load: DCP / raw"], rows
    )
    r = s.get("reshard") or {}
    if r:
        lines += [
            "",
            f"Resharded load (FSDP2, saved by 2 ranks, loaded by 1) / same-size load: "
            f"{num(r.get('resharded_over_same_size'))} ({sec(r.get('load_w1_resharded_median_s'))} against "
            f"{sec(r.get('load_w2_median_s'))}; save at 2 ranks {sec(r.get('save_w2_median_s'))}).",
        ]
    return lines


def render_rendezvous_scale(doc: Summary) -> list[str]:
    s = doc["summary"]
    backends = [b for b in s if isinstance(s[b], Mapping) and "time_to_all_ranks_s" in s[b]]
    sizes = sorted({int(n) for b in backends for n in s[b]["time_to_all_ranks_s"]})
    headers = ["N"] + [h for b in backends for h in (f"{b}: all nodes ranked", f"{b}: store ops per node")]
    rows = [
        [str(n)]
        + [
            cell
            for b in backends
            for cell in (
                sec(s[b]["time_to_all_ranks_s"].get(str(n))),
                num(s[b]["ops_per_node_mean"].get(str(n)), 1),
            )
        ]
        for n in sizes
    ]
    lines = table(headers, rows)
    growth = "; ".join(
        f"{b}: time ~ N^{num(s[b].get('time_growth_exponent'))}, ops per node ~ N^{num(s[b].get('ops_growth_exponent'))}"
        + (f", failed at N = {s[b]['failed_n']}" if s[b].get("failed_n") else "")
        for b in backends
    )
    return [*lines, "", f"Growth against the smallest N: {growth}."]


def render_throughput(doc: Summary) -> list[str]:
    rows = [
        [
            str(r["world"]) + (" (oversubscribed)" if r.get("oversubscribed") else ""),
            f"{r['efficiency']:.2f}",
            f"{r['speedup']:.2f}",
            f"{r['tokens_per_s']:.0f}",
        ]
        for r in doc["summary"].get("by_world") or []
    ]
    return table(["ranks", "efficiency", "speedup", "tokens/s"], rows)


def _final(diff: float | None) -> str:
    if diff is None:
        return DASH
    return "0 (bit for bit)" if diff == 0 else f"{diff:.3g}"


def render_soak(doc: Summary) -> list[str]:
    paths = doc["summary"].get("paths") or {}
    label = {"in-process": "in place", "process": "restart path"}
    rows = []
    for path, p in paths.items():
        rows.append(
            [
                label.get(path, path),
                num(p.get("goodput"), 3),
                f"{p['events_survived']} / {p['events_total']}",
                str(p["job_deaths"]),
                f"{p['final_samples_lost']} / {p['final_samples_repeated']}",
                str(p["steps_redone"]),
                _final(p.get("final_max_abs_diff")),
            ]
        )
    lines = table(
        [
            "path",
            "goodput (vs no events)",
            "events survived",
            "job deaths",
            "samples lost / repeated",
            "steps redone",
            "final parameters vs reference",
        ],
        rows,
    )
    kinds = sorted({k for p in paths.values() for k in p.get("by_kind") or {}})
    if kinds:
        lines += [""] + table(
            ["event → recovery, median (n)", *(label.get(p, p) for p in paths)],
            [
                [k]
                + [
                    f"{sec(dig(p, 'by_kind', k, 'recovery_median_s'))} ({dig(p, 'by_kind', k, 'n')}), "
                    f"{dig(p, 'by_kind', k, 'steps_redone')} redone"
                    if dig(p, "by_kind", k)
                    else DASH
                    for p in paths.values()
                ]
                for k in kinds
            ],
        )
    return lines


def render_generic(doc: Summary) -> list[str]:
    scalars = [
        (k, v) for k, v in doc["summary"].items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)
    ]
    return table(["figure", "value"], [[k, num(v, 3) if isinstance(v, float) else str(v)] for k, v in scalars])


RENDERERS: dict[str, Callable[[Summary], list[str]]] = {
    "scale_events": render_scale_events,
    "failures": render_failures,
    "framework_events": render_framework_events,
    "step_overhead": render_step_overhead,
    "step_overhead_hf": render_step_overhead_hf,
    "step_overhead_snapshot": render_step_overhead_snapshot,
    "hydration": render_hydration,
    "checkpoint": render_checkpoint,
    "rendezvous_scale": render_rendezvous_scale,
    "throughput": render_throughput,
    "soak": render_soak,
}


def render_figures(docs: Mapping[str, Summary]) -> str:
    """The "Latest figures" block of benchmarks/README.md: every expected section, then any other summary."""
    keys = [*EXPECTED, *sorted(k for k in docs if k not in EXPECTED)]
    out: list[str] = []
    for key in keys:
        out += [f"### Latest: {key}", ""]
        doc = docs.get(key)
        if doc is None:
            out += [f"No summary file: `{EXPECTED[key]}` writes it.", ""]
            continue
        out += [provenance(doc), ""]
        out += RENDERERS.get(doc["benchmark"], render_generic)(doc)
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- README.md: what each event costs


def _cell(doc: Summary | None, kind: str, variant: str, *, pause: bool = False) -> str:
    stats = dig(doc or {}, "summary", "by_kind", kind, variant)
    if not stats:
        return DASH
    if stats.get("ok", 0) == 0:
        return "did not recover"
    text = sec(stats.get("downtime_median_s"))
    if pause and stats.get("pause_median_s") is not None:
        text += f" (the survivors paused {sec(stats['pause_median_s'])})"
    lost_text = steps_lost(stats.get("steps_lost_median"))
    return f"{text}, **{lost_text}**" if variant == OURS else f"{text}, {lost_text}"


def _pair(doc: Summary | None, kinds: tuple[str, str], variant: str) -> str:
    a, b = (dig(doc or {}, "summary", "by_kind", k, variant) for k in kinds)
    if not a or not b:
        return DASH
    down = f"{sec(a.get('downtime_median_s'))} / {sec(b.get('downtime_median_s'))}"
    lost_text = steps_lost(a.get("steps_lost_median"), b.get("steps_lost_median"))
    return f"{down}, **{lost_text}**" if variant == OURS else f"{down}, {lost_text}"


def _fallbacks(doc: Summary | None, kinds: Sequence[str]) -> str:
    """`` (1 of 4 restarted)`` when some of the default variant's events did not run in place, else nothing."""
    modes = [m for k in kinds for m in dig(doc or {}, "summary", "by_kind", k, OURS, "modes") or []]
    other = len(modes) - modes.count("in-place")
    return f" ({other} of {len(modes)} restarted)" if other else ""


def _etcd(doc: Summary | None, path: str) -> str:
    """What etcd restarts and pauses did to one soak path: new rounds and steps redone, over how many events."""
    kinds = [dig(doc or {}, "summary", "paths", path, "by_kind", k) for k in ("etcd_restart", "etcd_pause")]
    seen = [k for k in kinds if k]
    if not seen:
        return DASH
    n = sum(k["n"] for k in seen)
    survived = sum(k["survived"] for k in seen)
    rounds = sum(k.get("new_rounds", 0) for k in seen)
    redone = sum(k["steps_redone"] for k in seen)
    stops = "training does not stop" if rounds == 0 else f"{rounds} new round(s)"
    lost = steps_lost(redone)
    text = f"{stops}, **{lost}**" if path == "in-process" else f"{stops}, {lost}"
    return text + f" ({survived} of {n} events survived)"


def _run(doc: Summary | None, what: str) -> str:
    """``what, 2026-11-23, commit `abc1234`, load 0.2 – 1.1 on 2 CPUs``."""
    if doc is None:
        return f"{what}: no summary file"
    commit = dig(doc, "versions", "git_commit") or "unknown commit"
    changed = dig(doc, "versions", "git_dirty")
    dirty = f" + local changes to {', '.join(changed)}" if changed else ""
    return f"{what}, {doc['started_at'][:10]}, commit `{commit}`{dirty}, {load_note(doc, short=True)}"


def render_event_costs(docs: Mapping[str, Summary]) -> str:
    """The "What each event costs" block of README.md."""
    scale, fail, fsdp = docs.get("scale_events"), docs.get("failures"), docs.get("failures_fsdp")
    frame, soak = docs.get("framework_events"), docs.get("soak")
    base_scale = baseline_of(scale) if scale else None
    base_fail = baseline_of(fail) if fail else None
    step = dig(scale or fail or {}, "params", "timers", "step_time_s")
    ckpt = dig(scale or fail or {}, "params", "train", "ckpt_every")
    per_kind = dig(fail or {}, "summary", "by_kind", "rank_crash", OURS, "n")
    runs = [
        _run(scale, f"`scale_events.py --{scale['mode'] if scale else 'quick'}`"),
        _run(
            fail,
            f"`failures.py --{fail['mode'] if fail else 'quick'}`"
            + (f" ({per_kind} of each failure)" if per_kind else ""),
        ),
        _run(fsdp, "with `--train-args=--fsdp` for the sharded row"),
        _run(soak, f"`soak.py --{soak['mode'] if soak else 'smoke'}` for etcd"),
    ]
    first = scale or fail or {}
    cpus = dig(first, "machine", "usable_cpus")
    gpus = dig(first, "machine", "gpus")
    machine = f"{cpus}-core " if cpus else ""
    machine += f"machine with {len(gpus)} GPU(s)" if gpus else "CPU machine"
    model = dig(first, "params", "train", "model")
    out = [
        f"Measured by [`benchmarks/`](benchmarks/README.md) on a {machine} ("
        + (f"{model} model, " if model else "")
        + ("NCCL, " if gpus else "gloo, ")
        + (f"{step:g} s steps, " if step else "")
        + (f"a checkpoint every {ckpt} steps for the restart paths to resume from" if ckpt else "periodic checkpoints")
        + "): "
        + "; ".join(runs)
        + ". Ratios within a run are what to compare.",
    ]
    yr, crash_loss = ("yield", "rejoin"), ("rank_crash", "node_loss")
    hang_timeout = dig(fail or {}, "params", "timers", "hang_timeout_s")
    found = sec(dig(fail or {}, "summary", "by_kind", "hang", OURS, "detect_median_s"))
    rows = [
        [
            "a node joins",
            f"downtime {_cell(scale, 'join', OURS, pause=True)}{_fallbacks(scale, ['join'])}",
            _cell(scale, "join", RESTART),
            _cell(scale, "join", base_scale or ""),
        ],
        [
            "a node leaves gracefully (SIGTERM)",
            _cell(scale, "leave", OURS) + _fallbacks(scale, ["leave"]),
            _cell(scale, "leave", RESTART),
            _cell(scale, "leave", base_scale or ""),
        ],
        [
            "`hyperpodctl yield 1` / `uncap`",
            _pair(scale, yr, OURS) + _fallbacks(scale, yr),
            _pair(scale, yr, RESTART),
            "(no such operation)",
        ],
        [
            "etcd restarted, or paused for seconds",
            _etcd(soak, "in-process"),
            _etcd(soak, "process"),
            DASH,
        ],
        [
            "a rank crashes (kill -9)",
            "repaired in place: the node's spare rank takes its place, hydrated from the survivors; "
            + _cell(fail, "rank_crash", OURS)
            + _fallbacks(fail, ["rank_crash"]),
            _cell(fail, "rank_crash", RESTART),
            _cell(fail, "rank_crash", base_fail or ""),
        ],
        [
            "a node is lost (kill -9 of its launcher and ranks)",
            "the survivors re-form without it in place (no wait for its lease); "
            + _cell(fail, "node_loss", OURS)
            + _fallbacks(fail, ["node_loss"]),
            _cell(fail, "node_loss", RESTART),
            _cell(fail, "node_loss", base_fail or ""),
        ],
        [
            f"a rank hangs (SIGSTOP, `--hang-timeout {num(hang_timeout)}`)",
            f"only the culprit is killed, then repaired as a crash; {_cell(fail, 'hang', OURS)}, found after {found}"
            + _fallbacks(fail, ["hang"]),
            _cell(fail, "hang", RESTART),
            "not detected",
        ],
        [
            "a rank crashes / a node is lost, **sharded (FSDP2) model**",
            "restored from the in-memory snapshots ring peers hold (`--snapshot-every 1`): "
            + _pair(fsdp, crash_loss, OURS)
            + _fallbacks(fsdp, crash_loss),
            _pair(fsdp, crash_loss, RESTART),
            _pair(fsdp, crash_loss, (baseline_of(fsdp) if fsdp else None) or ""),
        ],
    ]
    torchrun = TORCHRUN_LABEL.get(base_scale or "", "torchrun")
    headers = [
        "event",
        "in place (every rank uses `ElasticTraining`)",
        "restart path (`--restart-mode process`, or a script without that API)",
        f"{torchrun}, same run",
    ]
    out += ["", *table(headers, rows)]
    if frame:
        s = frame["summary"]
        out += [
            "",
            "A Hugging Face `Trainer` job moves in place too (`elastic_init()`, `ElasticTrainer`, `ElasticCallback`; "
            f"Lightning: `elastic.fit`): a join cost {sec(s.get('join_in-place_downtime_s'))} against "
            f"{sec(s.get('join_restart_downtime_s'))} on the restart path in the same run, a leave "
            f"{sec(s.get('leave_in-place_downtime_s'))} against {sec(s.get('leave_restart_downtime_s'))} "
            f"({_run(frame, '`framework_events.py --' + frame['mode'] + '`')}; "
            "[integrations_transformers.md](docs/integrations_transformers.md), "
            "[framework_events](benchmarks/README.md#framework_events)).",
        ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- markers


def replace_block(text: str, name: str, body: str, *, where: str) -> str:
    """``text`` with the lines between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced by ``body``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ReportError(f"{where}: expected one {begin} and one {end} line")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n<!-- generated by benchmarks/report.py from benchmarks/results/summary/: do not edit -->\n{body}{end}{tail}"


def render_files(summary_dir: Path, bench_readme: Path, main_readme: Path) -> dict[Path, str]:
    """Each README's text with its block rendered from ``summary_dir``."""
    docs = load_summaries(summary_dir)
    return {
        bench_readme: replace_block(bench_readme.read_text(), FIGURES, render_figures(docs), where=str(bench_readme)),
        main_readme: replace_block(
            main_readme.read_text(), EVENT_COSTS, render_event_costs(docs), where=str(main_readme)
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a README is out of date; write nothing")
    parser.add_argument("--summaries", type=Path, default=SUMMARY_DIR, help=f"summary files [{SUMMARY_DIR}]")
    parser.add_argument("--bench-readme", type=Path, default=BENCH_README, help=argparse.SUPPRESS)
    parser.add_argument("--main-readme", type=Path, default=MAIN_README, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        rendered = render_files(args.summaries, args.bench_readme, args.main_readme)
    except ReportError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    stale = [path for path, text in rendered.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(
                f"report.py: {path} is out of date with {args.summaries}: run python benchmarks/report.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path in stale:
        path.write_text(rendered[path])
        print(f"rewrote {path}")
    if not stale:
        print("the READMEs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
