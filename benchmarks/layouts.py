"""Model layouts compared in one run: ``scale_events.py`` and ``failures.py`` with ``--layouts ddp,fsdp,hsdp``.

Each layout is the example trainer with one flag (:data:`LAYOUT_FLAGS`): a replicated model (DDP), FSDP2
over the whole world, or HSDP (shards inside a node, a replica per node). Every launcher variant runs the
same scenario once per layout, one after the other on the same machine, so the layouts' costs (downtime,
survivors' pause, steps lost, bytes sent between ranks) and torchrun's under each are measured side by
side. The summary keeps each layout's usual summary under ``by_layout`` and a compact ``layout_comparison``
(per event kind and layout: hyperpodrun in place, the torchrun baseline, their ratio).

Everything but the plot is pure, unit-tested without starting anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import BenchmarkResult, TrainArgs, pyplot
from scale_analysis import BASELINES

#: The example trainer's flags per layout.
LAYOUT_FLAGS: dict[str, tuple[str, ...]] = {"ddp": (), "fsdp": ("--fsdp",), "hsdp": ("--hsdp",)}
#: What the comparison reads of each layout's summary, for hyperpodrun in place and the baseline.
OURS = "hyperpodrun"
_COMPARED = ("downtime_median_s", "pause_median_s", "steps_lost_median")


def parse_layouts(text: str, *, train_extra: Sequence[str] = ()) -> tuple[str, ...]:
    """``--layouts``: known names, no repeats, and no layout flag already in ``--train-args``."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError("--layouts: name at least one of " + ", ".join(LAYOUT_FLAGS))
    unknown = [n for n in names if n not in LAYOUT_FLAGS]
    if unknown:
        raise ValueError(f"--layouts: unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUT_FLAGS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--layouts: {text!r} names a layout twice")
    clash = sorted({f for flags in LAYOUT_FLAGS.values() for f in flags} & set(train_extra))
    if clash:
        raise ValueError(f"--layouts sets the layout itself: drop {' '.join(clash)} from --train-args")
    return names


def layout_train(train: TrainArgs, layout: str) -> TrainArgs:
    """The example's run for ``layout``: ``train`` with the layout's flag added."""
    return dataclasses.replace(train, extra=(*train.extra, *LAYOUT_FLAGS[layout]))


def summarize_by_layout(
    runs: Sequence[dict[str, Any]], summarize: Callable[[list[dict[str, Any]]], dict[str, Any]]
) -> dict[str, Any]:
    """``summarize`` (the benchmark's usual summary) of each layout's runs, and their comparison."""
    layouts = list(dict.fromkeys(run["layout"] for run in runs))
    by_layout = {layout: summarize([run for run in runs if run["layout"] == layout]) for layout in layouts}
    return {"layouts": layouts, "by_layout": by_layout, "layout_comparison": compare_layouts(by_layout)}


def compare_layouts(by_layout: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per event kind and layout: hyperpodrun's medians, the baseline's, the downtime ratio, the bytes moved.

    ``comparison[kind][layout]`` holds ``hyperpodrun`` and ``baseline`` (``{"variant": ..., <medians>}``),
    ``downtime_ratio`` (ours over the baseline's, None without both) and ``bytes_moved`` (hyperpodrun's, per
    event, None where its path does not count them).
    """
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for layout, summary in by_layout.items():
        moved = (summary.get("hyperpodrun_bytes_moved") or {}).get(OURS) or {}
        for kind, variants in (summary.get("by_kind") or {}).items():
            ours = variants.get(OURS) or {}
            base_name = next((b for b in BASELINES if b in variants), None)
            base = variants.get(base_name) or {}
            mine, theirs = ours.get("downtime_median_s"), base.get("downtime_median_s")
            out.setdefault(kind, {})[layout] = {
                "hyperpodrun": {m: ours.get(m) for m in _COMPARED} | {"modes": ours.get("modes") or []},
                "baseline": {"variant": base_name} | {m: base.get(m) for m in _COMPARED},
                "downtime_ratio": mine / theirs if mine is not None and theirs else None,
                "bytes_moved": moved.get(kind, []),
            }
    return out


def run_label(run: dict[str, Any]) -> str:
    """A run's variant, with its layout when the run compared layouts."""
    return f"{run['variant']} [{run['layout']}]" if run.get("layout") else str(run["variant"])


def plot_layouts(result: BenchmarkResult, comparison: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """Median downtime per event kind: hyperpodrun in place (solid) and the baseline (light), per layout."""
    plt = pyplot()
    kinds = list(comparison)
    layouts = list(dict.fromkeys(layout for by in comparison.values() for layout in by))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, 2 * len(layouts))
    for j, layout in enumerate(layouts):
        for k, (who, alpha) in enumerate((("hyperpodrun", 1.0), ("baseline", 0.4))):
            xs = [x + (2 * j + k - len(layouts) + 0.5) * width for x in range(len(kinds))]
            ys = [((comparison[kind].get(layout) or {}).get(who) or {}).get("downtime_median_s") or 0 for kind in kinds]
            label = f"{layout}: {'hyperpodrun' if who == 'hyperpodrun' else 'torchrun'}"
            ax.bar(xs, ys, width, color=f"C{j}", alpha=alpha, label=label)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("downtime, seconds (median)")
    ax.set_title(f"{result.name} ({result.mode}): layouts in one run", fontsize=10)
    ax.legend(fontsize=8, ncol=len(layouts))
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
