"""The sections of benchmarks/README.md's "Latest figures": one renderer per benchmark, and the formatting
they share with :mod:`report_costs`. Each renderer takes a summary file's content and returns Markdown lines,
the ratios against the baseline measured in the same run first; ``report.py`` writes them into the README.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

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
    "world_reshard": "python benchmarks/world_reshard.py --quick",
    "checkpoint": "python benchmarks/checkpoint.py --quick",
    "rendezvous_scale": "python benchmarks/rendezvous_scale.py --quick",
    "throughput": "python benchmarks/throughput.py --quick",
    "soak": "python benchmarks/soak.py --smoke --paths in-process,process",
    "state_scaling": "python benchmarks/state_scaling.py --quick",
    "start_method": "python benchmarks/start_method.py --quick",
    "own_copy": "python benchmarks/own_copy.py --quick",
    "new_mesh_step": "python benchmarks/new_mesh_step.py --quick",
}
DASH = "–"

Summary = dict[str, Any]


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


def changed_code(doc: Summary) -> list[str]:
    """The run's local changes to measured code: its ``git_dirty`` files, less the report scripts (which
    render results and measure nothing; results of older runs may list them)."""
    dirty = dig(doc, "versions", "git_dirty") or []
    return [f for f in dirty if not re.fullmatch(r"benchmarks/report\w*\.py", f)]


def provenance(doc: Summary) -> str:
    """One line: command, date, commit (with local changes if any), duration and load."""
    versions = doc.get("versions") or {}
    commit = versions.get("git_commit") or "unknown commit"
    dirty = changed_code(doc)
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


def render_layouts(doc: Summary, render: Callable[[Summary], list[str]]) -> list[str]:
    """A run that compared layouts (``--layouts``): one row per event kind and layout, then each layout's
    section as ``render`` draws a one-layout run."""
    s = doc["summary"]
    base = next(
        (
            TORCHRUN_LABEL[b["baseline"]["variant"]]
            for by in s["layout_comparison"].values()
            for b in by.values()
            if b["baseline"]["variant"] in TORCHRUN_LABEL
        ),
        "the baseline",
    )
    rows = []
    for kind, by_layout in s["layout_comparison"].items():
        for layout in s["layouts"]:
            c = by_layout.get(layout)
            if c is None:
                continue
            ours, theirs = c["hyperpodrun"], c["baseline"]
            moved = [b for b in c["bytes_moved"] if b is not None]
            rows.append(
                [
                    kind,
                    layout,
                    ratio(c["downtime_ratio"]),
                    f"{sec(ours['downtime_median_s'])} (pause {sec(ours['pause_median_s'])}), "
                    f"{steps(ours['steps_lost_median'])} lost, {ours['modes'].count('in-place')}/{len(ours['modes'])} "
                    "in place",
                    f"{sec(theirs['downtime_median_s'])}, {steps(theirs['steps_lost_median'])} lost",
                    ", ".join(_mb(b) for b in moved) if moved else DASH,
                ]
            )
    lines = table(
        ["event", "layout", f"in place / {base}: downtime", "in place: downtime (pause), lost", base, "bytes sent"],
        rows,
    )
    for layout in s["layouts"]:
        flags = " ".join(dig(doc, "params", "layouts", layout) or []) or "no layout flag"
        lines += ["", f"**{layout}** (`{flags}`):", ""]
        lines += render({**doc, "summary": s["by_layout"][layout]})
    return lines


def render_scale_events(doc: Summary) -> list[str]:
    s = doc["summary"]
    if "by_layout" in s:
        return render_layouts(doc, render_scale_events)
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
    lines += bytes_moved(s)
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


def bytes_moved(s: Mapping[str, Any]) -> list[str]:
    """HSDP: the bytes sent between replicas at each event, by kind (none on the paths that do not count them)."""
    by_kind = {
        k: v for k, v in (dig(s, "hyperpodrun_bytes_moved", OURS) or {}).items() if any(b is not None for b in v)
    }
    if not by_kind:
        return []
    moved = "; ".join(f"{k} {', '.join(_mb(b) for b in v)}" for k, v in by_kind.items())
    return [f"Bytes sent between replicas at each event: {moved}."]


def render_failures(doc: Summary) -> list[str]:
    s = doc["summary"]
    if "by_layout" in s:
        return render_layouts(doc, render_failures)
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
    lines += bytes_moved(s)
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
    ranks = doc["params"].get("ranks_per_node", 1)
    for kind, label in (("join", f"join (1 → 2 nodes of {ranks})"), ("leave", f"leave (2 → 1 node of {ranks})")):
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
        + _chosen_intervals(s)
    ]


def _chosen_intervals(s: dict[str, Any]) -> str:
    """The intervals ``--snapshot-every auto`` chose, where the run used it."""
    if s.get("snapshot_every", "1") != "auto":
        return " Snapshots every step (`--snapshot-every 1`)."
    chosen = ", ".join(str(every) for every in s.get("chosen_intervals") or []) or DASH
    overheads = s.get("chosen_overheads") or []
    worst = f"{max(overheads):.2%}" if overheads else DASH
    return f" `--snapshot-every auto` chose every {chosen} step(s) (expected overhead at most {worst})."


def render_hydration(doc: Summary) -> list[str]:
    s = doc["summary"]
    ranks = dig(doc, "params", "ranks")
    return [
        f"Hydration / broadcast of the same bytes: **{num(s.get('ratio_to_broadcast'))}** (per repetition "
        f"{num(s.get('ratio_per_rep_min'))} – {num(s.get('ratio_per_rep_max'))}; target ≥ 0.5): "
        f"{num(s.get('hydration_mb_per_s'), 0)} against {num(s.get('broadcast_mb_per_s'), 0)} MB/s, "
        f"{num(s.get('state_mb'), 0)} MB of state, {ranks} ranks."
    ]


def render_world_reshard(doc: Summary) -> list[str]:
    s = doc["summary"]
    ranks = dig(doc, "params", "ranks")
    return [
        f"DCP's time over ours, same processes: gather **{num(s.get('gather_speedup'))}x**, load "
        f"**{num(s.get('load_speedup'))}x** ({num(s.get('state_mb'), 0)} MB of state, "
        f"{num((s.get('params') or 0) / 1e6, 0)} M parameters, {ranks} gloo ranks): gather "
        f"{num(s.get('gather_new_median_s'))} s against {num(s.get('gather_dcp_median_s'))} s, load "
        f"{num(s.get('load_new_median_s'))} s against {num(s.get('load_dcp_median_s'))} s."
    ]


def render_own_copy(doc: Summary) -> list[str]:
    s = doc["summary"]
    step = s.get("step_ms") or {}

    def ratio(key: str) -> str:
        ci = s.get(key) or {}
        return f"{num(ci.get('ratio'))} (95 % CI {num(ci.get('ci_low'))} – {num(ci.get('ci_high'))})"

    return [
        f"HSDP's copy one step back, {num(s.get('state_mb'), 0)} MB of state on {s.get('device')}: a step with the copy "
        f"after the optimizer step (the product's) / without a copy **{ratio('overlapped_over_none')}**; with the "
        f"copy in the pre-step hook / without {ratio('at_seal_over_none')}; {num(step.get('none'))} / "
        f"{num(step.get('overlapped'))} / {num(step.get('at_seal'))} ms a step; {s.get('copies_checked')} copies "
        "checked against the state of their step."
    ]


def render_new_mesh_step(doc: Summary) -> list[str]:
    s, p = doc["summary"], doc.get("params") or {}
    return [
        f"The first step on a mesh new to the process ({p.get('replicas')} replica(s) x "
        f"{(p.get('world') or 0) // (p.get('replicas') or 1)} shard(s), the {p.get('model')} model), gradient clip "
        f"from the local shards / torch's clip: **{ci_text(s.get('first_step_local_over_torch'))}**; a steady step "
        f"{ci_text(s.get('steady_step_local_over_torch'))}. Medians: first step {num(s.get('torch_first_step_s'))} s "
        f"with torch's clip, {num(s.get('local_first_step_s'))} s from the local shards; steady step "
        f"{num(s.get('torch_steady_step_s'))} / {num(s.get('local_steady_step_s'))} s."
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


def render_start_method(doc: Summary) -> list[str]:
    s = doc["summary"]
    labels = {
        "start_s": "launcher start to first step",
        "restart_s": "rank killed to first step after the restart",
        "cpu_s": "CPU-seconds of the whole run",
    }
    rows = [
        [
            labels[figure],
            sec(s.get(f"spawn_{figure}_median")),
            sec(s.get(f"forkserver_{figure}_median")),
            ci_text(s.get(f"{figure}_ratio_ci"), 2),
        ]
        for figure in ("start_s", "restart_s", "cpu_s")
    ]
    head = f"{s.get('nproc')} ranks on one node, a rank killed and every rank restarted (`--max-restarts 1`):"
    return [head, "", *table(["figure", "spawn (median)", "forkserver (median)", "forkserver / spawn"], rows)]


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
    ranks = dig(doc, "params", "settings", "ranks_per_node") or 1
    kept = {label.get(path, path): p["siblings_kept"] for path, p in paths.items() if p.get("siblings_kept")}
    lines += ["", f"3 nodes of {ranks} rank{'s' * (ranks != 1)}."]
    if kept:
        lines[-1] += (
            " A rank event's siblings on its node went on as the same processes in "
            + ", ".join(f"{k[0]} of {k[1]} ({name})" for name, k in kept.items())
            + "."
        )
    return lines


def _mb(x: float | None) -> str:
    return DASH if x is None else f"{x / 1e6:.0f} MB" if x >= 1e7 else f"{x / 1e6:.1f} MB"


def _event_cost(seconds: float | None, redone: float | None = None, every: float | None = None) -> str:
    """``0.85 s``, or with steps redone against the interval in force: ``0.85 s, 3 redone (every 20)``."""
    if seconds is None:
        return DASH
    text = sec(seconds)
    if redone is not None:
        text += f", {steps(redone)} redone" + (f" (every {steps(every)})" if every is not None else "")
    return text


def render_state_scaling(doc: Summary) -> list[str]:
    sizes = doc["summary"].get("sizes") or []
    rows = []
    for z in sizes:
        overhead = z.get("snapshot_overhead")
        snapshot = DASH if z.get("snapshot_interval") is None else f"every {z['snapshot_interval']}"
        if overhead is not None:
            snapshot += f" ({overhead:.1%} of a step)"
        chain = sec(z.get("snapshot_chain_s"))
        if z.get("snapshot_mb_per_s"):
            chain += f" ({num(z['snapshot_mb_per_s'], 0)} MB/s)"
        join = _event_cost(z.get("join_pause_s"))
        if z.get("join_world"):
            join += f" (to {z['join_world']} ranks)"
        elif (z.get("outcomes") or {}).get("join", "").startswith("skipped"):
            join = "skipped (memory)"
        rows.append(
            [
                z["model"],
                f"{z['params'] / 1e6:.1f}M",
                _mb(z.get("state_bytes_per_rank")),
                snapshot,
                chain,
                f"{num(z.get('peak_rss_over_state'), 1)} ({num(z.get('peak_rss_less_floor_over_state'), 1)})",
                join,
                _event_cost(z.get("leave_pause_s")),
                _event_cost(z.get("crash_downtime_s"), z.get("crash_steps_redone"), z.get("crash_interval")),
                _event_cost(
                    z.get("node_loss_downtime_s"), z.get("node_loss_steps_redone"), z.get("node_loss_interval")
                ),
                f"{num(z.get('hydration_over_broadcast'))} / {num(z.get('hydration_over_memcpy'))}",
                num(z.get("throughput_ratio_vs_torchrun"), 3),
            ]
        )
    lines = table(
        [
            "size",
            "params",
            "state per rank",
            "snapshots (`auto`)",
            "one snapshot chain",
            "peak RSS / state (less the process floor)",
            "join: survivors' pause",
            "leave: survivors' pause",
            "rank crash: downtime",
            "node loss: downtime",
            "hydration over broadcast / over memcpy",
            "throughput / torchrun",
        ],
        rows,
    )
    lost = [
        f"{z['model']} {kind}: {how}"
        for z in sizes
        for kind, how in (("rank crash", z.get("crash_restored_from")), ("node loss", z.get("node_loss_restored_from")))
        if how and not how.startswith("snapshot")
    ]
    failed = [f"{z['model']}: {z['failure']}" for z in sizes if z.get("failure")]
    if lost:
        lines += [
            "",
            "Repairs that found no complete snapshot (state from the checkpoint, or a fresh model): "
            + "; ".join(lost)
            + ".",
        ]
    if failed:
        lines += ["", "Stopped early: " + "; ".join(failed) + "."]
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
    "world_reshard": render_world_reshard,
    "checkpoint": render_checkpoint,
    "rendezvous_scale": render_rendezvous_scale,
    "throughput": render_throughput,
    "soak": render_soak,
    "state_scaling": render_state_scaling,
    "start_method": render_start_method,
    "own_copy": render_own_copy,
    "new_mesh_step": render_new_mesh_step,
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
