"""HSDP's copy one step back: what it costs a training step, copied after each optimizer step beside the next
forward and backward (how ``ElasticTraining`` takes it) against copied in the pre-step hook, where the
optimizer waits for all of it, and against no copy.

With two HSDP replicas or more every rank copies its whole local state (parameters and optimizer state)
every step (``elastic_events.rounds.own_copy``). On a GPU that is a device-to-host copy of GBs a rank; if
the optimizer waits for it the GPU idles for the whole copy every step. One process, no group: a stack of
linear layers with AdamW on the device (CUDA when present), the copy driven by the same optimizer hooks as
in training. Variants interleaved, ``--reps`` times:

* ``none``: no copy (the baseline);
* ``at_seal``: started and sealed in the pre-step hook (the copy, then the optimizer);
* ``overlapped``: started after the optimizer step, sealed in the next pre-step hook (the product's way, which
  starts it at the step's end, in ``elastic_event_detected()``).

Each copy is checked: the sealed bytes equal the state at their step. On a CPU both copies are plain
``memcpy`` on the step's thread, so they should cost the same; the comparison that matters is a GPU's.

    python benchmarks/own_copy.py [--quick | --smoke] [--state-mb N] [--tokens N] [--reps N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import BenchmarkError, BenchmarkResult, format_table, median, parse_args, pyplot, ratio_ci, result_tag

NAME = "own_copy"
VARIANTS = ("none", "at_seal", "overlapped")
#: (state MB, tokens a step) by device and mode: the state is parameters + AdamW's two moments (fp32).
SIZES = {
    "cpu": {"smoke": (8, 64), "quick": (96, 256), "full": (384, 512)},
    "cuda": {"smoke": (64, 1024), "quick": (2048, 16384), "full": (6144, 32768)},
}
REPS = {"smoke": 2, "quick": 5, "full": 9}
STEPS = {"smoke": 3, "quick": 10, "full": 20}  # timed steps a repetition, after 2 untimed


def build(state_mb: int, device: Any) -> tuple[Any, Any, int]:
    """A stack of square linear layers whose parameters + AdamW state are about ``state_mb`` MB."""
    import torch

    params = state_mb * 2**20 // 12  # 4 bytes a parameter, 8 of AdamW's moments
    width = 2048 if params >= 8 * 2048 * 2048 else 256
    layers = max(1, params // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, width


class Driver:
    """One variant's copy, on the optimizer's hooks as in training; checks each sealed copy."""

    def __init__(self, variant: str, model: Any, opt: Any) -> None:
        from elastic_events.rounds.own_copy import OwnCopy
        from elastic_events.rounds.snapshot import capture

        self.variant, self.model, self.opt = variant, model, opt
        self.captured = capture(model, opt)  # once, as training keeps it (AdamW's state already exists)
        self.own = OwnCopy() if variant != "none" else None
        self.step = 0
        self.checked = 0
        self._handles = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]

    def _piece(self) -> Any:
        from elastic_events.rounds.snapshot import Piece

        c = self.captured
        return Piece(
            owner=0,
            round=0,
            world_size=1,
            step=self.step,
            layout=c.layout,
            small={"step": self.step},
            param_groups=c.param_groups(self.opt),
            tensors=c.tensors,
        )

    def _pre(self, *_: Any) -> None:
        if self.own is None:
            return
        if self.variant == "at_seal":
            self.own.take(self._piece())
        else:
            self.own.seal(self._piece())

    def _post(self, *_: Any) -> None:
        self.step += 1
        if self.own is not None and self.variant == "overlapped":
            self.own.start(self.captured.layout, self.captured.tensors)

    def check(self) -> None:
        """The sealed copy holds the state at its step (the live state, before the next step changes it)."""
        import torch

        from elastic_events.rounds.transfer import byte_view

        if self.own is None:
            return
        self.own.seal(self._piece())
        kept = self.own.piece()
        if kept is None or kept.step != self.step:
            raise BenchmarkError(f"{self.variant}: the sealed copy is of step {kept and kept.step}, not {self.step}")
        live = self._piece()
        for copied, tensor, entry in zip(kept.tensors, live.tensors, kept.layout.entries, strict=True):
            if not torch.equal(copied, byte_view(tensor).cpu()):
                raise BenchmarkError(f"{self.variant}: the copy of {entry.key} differs from the state at its step")
        self.checked += 1

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.own is not None:
            self.own.close()


def timed_steps(model: Any, opt: Any, batch: Any, steps: int, sync: Callable[[], None]) -> float:
    """Seconds a step, over ``steps`` steps after 2 untimed ones (the device drained at both ends)."""
    for _ in range(2):
        train_step(model, opt, batch)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, batch)
    sync()
    return (time.perf_counter() - start) / steps


def train_step(model: Any, opt: Any, batch: Any) -> None:
    opt.zero_grad(set_to_none=True)
    model(batch).float().pow(2).mean().backward()
    opt.step()


def measure(*, state_mb: int, tokens: int, reps: int, steps: int, device_name: str) -> dict[str, Any]:
    import torch

    device = torch.device(device_name)
    torch.backends.cuda.matmul.allow_tf32 = True
    model, opt, width = build(state_mb, device)
    batch = torch.randn(tokens, width, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    train_step(model, opt, batch)  # AdamW's state appears
    from elastic_events.rounds.snapshot import capture

    state_bytes = capture(model, opt).layout.state_bytes
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    checked = 0
    for rep in range(reps):
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            driver = Driver(variant, model, opt)
            try:
                times[variant].append(timed_steps(model, opt, batch, steps, sync))
                driver.check()
                checked += driver.checked
            finally:
                driver.close()
        print(f"own_copy: rep {rep + 1}/{reps}: " + ", ".join(f"{v} {times[v][-1] * 1e3:.1f} ms" for v in VARIANTS))
    return {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "state_bytes": state_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "width": width,
        "tokens": tokens,
        "steps_per_rep": steps,
        "step_s": times,
        "copies_checked": checked,
    }


def plot(data: dict[str, Any], path: Path) -> None:
    """Each variant's step times, one point a repetition, the median as a bar."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, variant in enumerate(VARIANTS):
        ms = [s * 1e3 for s in data["step_s"][variant]]
        ax.bar(i, median(ms), color="#cccccc")
        ax.plot([i] * len(ms), ms, "o", color="black", markersize=3)
    ax.set_xticks(range(len(VARIANTS)), VARIANTS)
    ax.set_ylabel("ms a step")
    ax.set_title(f"copy one step back, {data['state_bytes'] / 2**20:.0f} MB state, {data['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state-mb", type=int, default=None, help="parameters + AdamW state, MB (by mode and device)")
        p.add_argument("--tokens", type=int, default=None, help="rows of a step's batch (by mode and device)")
        p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (smoke 2, quick 5, full 9)")
        p.add_argument("--device", default=None, help="cuda when present, else cpu")

    ns = parse_args(__doc__.splitlines()[0], add_arguments=options, argv=argv)
    import torch

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    state_mb, tokens = SIZES[kind][ns.mode]
    state_mb, tokens = ns.state_mb or state_mb, ns.tokens or tokens
    reps = ns.reps or REPS[ns.mode]
    if reps < 2 or state_mb < 1 or tokens < 1:
        raise SystemExit("own_copy.py: --reps must be >= 2, --state-mb and --tokens >= 1")
    result = BenchmarkResult(
        name=NAME,
        mode=ns.mode,
        tag=result_tag(ns) or ("" if kind == "cpu" else "cuda"),
        params={"state_mb": state_mb, "tokens": tokens, "reps": reps, "steps": STEPS[ns.mode], "device": device},
        baseline="the same steps without a copy, interleaved in the same process",
        notes=[
            "One process, no collectives: only the copy's cost to the step is measured. On a CPU both copies "
            "are memcpy on the training thread and should cost the same."
        ],
    )
    data = measure(state_mb=state_mb, tokens=tokens, reps=reps, steps=STEPS[ns.mode], device_name=device)
    t = data["step_s"]
    summary: dict[str, Any] = {
        "device": data["device"],
        "state_mb": round(data["state_bytes"] / 2**20, 1),
        "step_ms": {v: round(median(t[v]) * 1e3, 3) for v in VARIANTS},
        "copies_checked": data["copies_checked"],
    }
    for variant in ("at_seal", "overlapped"):
        ci = ratio_ci([c / n for c, n in zip(t[variant], t["none"], strict=True)])
        summary[f"{variant}_over_none"] = {k: round(v, 4) for k, v in ci.items()}
    ci = ratio_ci([o / a for o, a in zip(t["overlapped"], t["at_seal"], strict=True)])
    summary["overlapped_over_at_seal"] = {k: round(v, 4) for k, v in ci.items()}
    result.samples, result.summary = data, summary
    path = result.write(ns.out)  # before the plot: a GPU machine may lack matplotlib
    try:
        plot(data, result.plot_path(ns.out))
    except ImportError as exc:
        print(f"own_copy: no plot ({exc})", file=sys.stderr)
    print(
        format_table(
            ["device", "state MB", "none ms", "at_seal ms", "overlapped ms", "at_seal/none", "overlapped/none"],
            [
                [
                    summary["device"],
                    summary["state_mb"],
                    summary["step_ms"]["none"],
                    summary["step_ms"]["at_seal"],
                    summary["step_ms"]["overlapped"],
                    summary["at_seal_over_none"]["ratio"],
                    summary["overlapped_over_none"]["ratio"],
                ]
            ],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
