"""README.md's "What each event costs": the table a reader sees first, from the scale_events, failures
(replicated and ``fsdp``), soak and framework_events summaries; ``report.py`` writes it into the README.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from report_figures import (
    DASH,
    OURS,
    RESTART,
    TORCHRUN_LABEL,
    Summary,
    baseline_of,
    changed_code,
    dig,
    load_note,
    num,
    sec,
    steps_lost,
    table,
)


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
    changed = changed_code(doc)
    dirty = f" + local changes to {', '.join(changed)}" if changed else ""
    return f"{what}, {doc['started_at'][:10]}, commit `{commit}`{dirty}, {load_note(doc, short=True)}"


def _nproc(doc: Summary) -> int:
    """Ranks per simulated node of a scenario run (summaries that do not say ran nodes of one rank)."""
    return int(dig(doc, "params", "timers", "nproc_per_node") or 1)


def _other_nodes(doc: Summary | None, first: Summary | None) -> str:
    """`` (nodes of N rank(s))`` when ``doc`` ran nodes of another size than ``first``, the caption's."""
    if doc is None or first is None or _nproc(doc) == _nproc(first):
        return ""
    return f" ({_nodes_of(_nproc(doc))})"


def _nodes_of(nproc: int) -> str:
    return f"nodes of {nproc} rank{'s' if nproc > 1 else ''}"


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
        _run(fsdp, "with `--train-args=--fsdp` for the sharded row" + _other_nodes(fsdp, scale or fail)),
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
        + (f"{_nodes_of(_nproc(first))}, " if first else "")
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
            f"Lightning: `elastic.fit`): on nodes of {frame['params'].get('ranks_per_node', 1)} ranks, a join cost "
            f"{sec(s.get('join_in-place_downtime_s'))} against "
            f"{sec(s.get('join_restart_downtime_s'))} on the restart path in the same run, a leave "
            f"{sec(s.get('leave_in-place_downtime_s'))} against {sec(s.get('leave_restart_downtime_s'))} "
            f"({_run(frame, '`framework_events.py --' + frame['mode'] + '`')}; "
            "[integrations_transformers.md](docs/integrations_transformers.md), "
            "[framework_events](benchmarks/README.md#framework_events)).",
        ]
    return "\n".join(out) + "\n"
