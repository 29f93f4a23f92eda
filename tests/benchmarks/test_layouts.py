"""``benchmarks/layouts.py``: the layouts one run of ``scale_events.py`` / ``failures.py`` compares, their
summaries side by side, and how the report renders them (pure functions, on made-up runs)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from support.bench_events import event


def _runs() -> list[dict[str, Any]]:
    return [
        {"variant": "hyperpodrun", "layout": "ddp", "events": [event("join", 1.0, 0, mode="in-place")]},
        {"variant": "torchrun-noshare", "layout": "ddp", "events": [event("join", 10.0, 4)]},
        {
            "variant": "hyperpodrun",
            "layout": "hsdp",
            "events": [
                event("join", 2.0, 0, mode="in-place", moved=3_000_000),
                event("join", 4.0, 0, mode="restart"),
            ],
        },
        {"variant": "torchrun-noshare", "layout": "hsdp", "events": [event("join", 8.0, 2), event("join", 8.0, 6)]},
    ]


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        ("ddp,tp", (), "unknown layout 'tp'"),
        ("ddp,ddp", (), "names a layout twice"),
        (" , ", (), "name at least one"),
        ("ddp,hsdp", ("--hsdp", "--dtype", "fp32"), "drop --hsdp from --train-args"),
    ],
)
def test_bad_layouts_are_refused_with_what_is_wrong(bench: Any, text: str, extra: tuple, message: str) -> None:
    layouts = bench("layouts")
    with pytest.raises(ValueError, match=message):
        layouts.parse_layouts(text, train_extra=extra)


def test_each_layout_adds_its_flag_to_the_same_run(bench: Any) -> None:
    layouts, common = bench("layouts"), bench("common")
    assert layouts.parse_layouts("hsdp, ddp,fsdp") == ("hsdp", "ddp", "fsdp")
    train = common.TrainArgs(steps=5, extra=("--dtype", "fp32"))
    assert layouts.layout_train(train, "ddp") == train
    hsdp = layouts.layout_train(train, "hsdp")
    assert hsdp.extra == ("--dtype", "fp32", "--hsdp") and hsdp.steps == 5


def test_the_cli_refuses_bad_layouts_in_one_line(bench: Any) -> None:
    se = bench("scale_events")
    assert se.chosen_layouts(argparse.Namespace(layouts=None, train_args="")) == ()
    with pytest.raises(SystemExit, match="drop --fsdp"):
        se.chosen_layouts(argparse.Namespace(layouts="fsdp", train_args="--fsdp"))


def test_each_layout_is_summarized_alone_and_compared_with_its_own_baseline(bench: Any) -> None:
    layouts, se = bench("layouts"), bench("scale_events")
    summary = layouts.summarize_by_layout(_runs(), se.summarize)
    assert summary["layouts"] == ["ddp", "hsdp"]
    assert summary["by_layout"]["ddp"]["by_kind"]["join"]["hyperpodrun"]["n"] == 1
    assert summary["by_layout"]["hsdp"]["by_kind"]["join"]["torchrun-noshare"]["steps_lost_median"] == 4
    join = summary["layout_comparison"]["join"]
    assert join["ddp"]["downtime_ratio"] == pytest.approx(0.1)
    assert join["hsdp"]["downtime_ratio"] == pytest.approx(3.0 / 8.0)
    assert join["hsdp"]["hyperpodrun"]["modes"] == ["in-place", "restart"]
    assert join["hsdp"]["baseline"] == {
        "variant": "torchrun-noshare",
        "downtime_median_s": 8.0,
        "pause_median_s": 7.5,
        "steps_lost_median": 4,
    }
    assert join["hsdp"]["bytes_moved"] == [3_000_000, None] and join["ddp"]["bytes_moved"] == [None]


def test_the_report_renders_a_row_per_kind_and_layout_then_each_layout(bench: Any) -> None:
    layouts, se, figures = bench("layouts"), bench("scale_events"), bench("report_figures")
    doc = {
        "benchmark": "scale_events",
        "params": {"layouts": {"ddp": [], "hsdp": ["--hsdp"]}},
        "summary": layouts.summarize_by_layout(_runs(), se.summarize),
    }
    lines = figures.render_scale_events(doc)
    assert [line for line in lines if line.startswith("| join |")] == [
        "| join | ddp | 0.10 | 1.00 s (pause 0.50 s), 0 lost, 1/1 in place | 10.0 s, 4 lost | – |",
        "| join | hsdp | 0.38 | 3.00 s (pause 2.50 s), 0 lost, 1/2 in place | 8.00 s, 4 lost | 3.0 MB |",
    ]
    assert lines[0].split(" | ")[2] == "in place / torchrun (no shared store): downtime"
    sections = [lines.index("**ddp** (`no layout flag`):"), lines.index("**hsdp** (`--hsdp`):")]
    assert sections[0] < sections[1]
    assert "| join (2) | 0.38 | 0.30 | 3.00 s (pause 2.50 s), 0 lost, 1/2 in place | 8.00 s, 4 lost |" in lines
