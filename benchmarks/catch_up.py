"""A join that heals in the background: what the survivor pauses for, against today's hydration in the same run.

Two gloo processes: a survivor (rank 0) training an fp32 MLP with AdamW and a joiner (rank 1). Each
repetition, interleaved in the same processes:

* full (today): at the entry step the survivor stops and sends its whole state (parameters and the
  optimizer's, ``broadcast_tensors``, the skeleton as one object); its pause is that transfer;
* replay (``elastic_events.rounds.catch_up``): a thread copies the survivor's state of step ``s`` into
  host buffers beside step ``s + 1``'s forward and backward (that step's optimizer step waits for the
  copy) and sends it on a side group while the survivor trains on; each step's record (averaged gradients
  and group options, :class:`~elastic_events.rounds.catch_up.DeltaLog`) follows the copy as it is made; the
  joiner loads the copy and replays each record as it arrives. The entry step ``T`` comes from
  :func:`~elastic_events.rounds.catch_up.plan_entry` (the full variant's time just before, over the steady
  step time). The joiner meets the survivor at step ``T + 1``'s all-reduce (a barrier here) before it has
  replayed ``T``, contributing no samples, and must have applied ``T`` and ``T + 1`` by ``T + 2``'s. The
  survivor's pause is its extra time over those steps against its steady step. Then the joiner's state is
  compared with the survivor's, tensor by tensor (``exact``).

Also reported: the survivor's step time while the copy travels, over its steady step time (two cores
shared by the training step, gloo's threads and the joiner's replay). Not measured here: the group switch
itself (13-30 ms per event on this machine in the scale-event benchmarks' logs), which both variants pay.

    python benchmarks/catch_up.py [--quick | --smoke] [--state-mb N]
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from common import (
    BenchmarkResult,
    exit_worker,
    format_table,
    median,
    parse_args,
    plot_repetitions,
    result_tag,
    run_rank_workers,
)

NAME = "catch_up"
STATE_MB = {"smoke": 4, "quick": 96, "full": 384}  # parameters + AdamW's two moments (3x the parameters)
REPS = {"smoke": 2, "quick": 5, "full": 9}
WIDTH = 512
BATCH = 256
MAX_RECORDS = 32


# --------------------------------------------------------------------------- worker side


def worker_main(rank: int, world: int, port: int, state_mb: int, reps: int, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from elastic_events.rounds.catch_up import DeltaLog, EntryKind, StepDelta, plan_entry, replay
    from elastic_events.rounds.hydration import allocate_tensors, split_tensors
    from elastic_events.rounds.transfer import broadcast_tensors

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    side = dist.new_group([0, 1])  # the background copy's own connections, beside the training group's
    cpu = torch.device("cpu")
    layers = max(1, state_mb * 2**20 // (3 * 4 * WIDTH * WIDTH))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    step = [0]

    def train_step(before_apply: Callable[[], object] | None = None) -> float:
        """One step; ``before_apply`` runs between the backward and the optimizer step (where DDP's all-reduce
        completes: a joiner entering at this step meets the survivors there)."""
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step[0])
        x = torch.randn(BATCH, WIDTH, generator=g)
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if before_apply is not None:
            before_apply()
        optimizer.step()
        optimizer.zero_grad()
        step[0] += 1
        return time.perf_counter() - t0

    if rank == 0:
        train_step()  # the survivor has optimizer state; the joiner does not yet

    def snapshot() -> tuple[object, int, list[torch.Tensor]]:
        """The optimizer state's skeleton, the step, and the tensors (parameters, then the optimizer's), together."""
        skeleton, optim = split_tensors(optimizer.state_dict())
        return skeleton, step[0], [*(p.detach() for p in params), *optim]

    def state_tensors() -> list[torch.Tensor]:
        return snapshot()[2]

    def send_state(held: tuple[object, int, list[torch.Tensor]] | None, group: object) -> None:
        """Rank 0 sends ``held`` (a :func:`snapshot`, its tensors possibly a copy); rank 1 loads it into its
        model and optimizer and takes its step."""
        box = [held[:2] if held is not None else None]
        dist.broadcast_object_list(box, src=0, group=group)
        skeleton, at = box[0]
        if held is not None:
            broadcast_tensors(held[2], src=0, group=group, device=cpu)
            return
        received, optim = allocate_tensors(skeleton, cpu)
        broadcast_tensors([*(p.detach() for p in params), *optim], src=0, group=group, device=cpu)
        optimizer.load_state_dict(received)
        step[0] = at

    def send_record(delta: StepDelta | None, group: object) -> StepDelta | None:
        box = [None if delta is None else (delta.step, delta.hyper, [g is None for g in delta.grads])]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            return None
        at, hyper, missing = box[0]
        grads = (
            list(delta.grads)
            if delta is not None
            else [None if m else torch.empty_like(p) for p, m in zip(params, missing)]
        )
        broadcast_tensors([g for g in grads if g is not None], src=0, group=group, device=cpu)
        return StepDelta(step=at, grads=tuple(grads), hyper=hyper)

    def exact() -> bool:
        mine = state_tensors()
        theirs = [t.clone() for t in mine]
        broadcast_tensors(theirs, src=0, device=cpu)
        return all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))

    samples: dict[str, list] = {
        k: []
        for k in (
            "full_s",
            "replay_pause_s",
            "copy_step_extra_s",
            "entry_step_extra_s",
            "caught_up_step_extra_s",
            "steady_step_s",
            "heal_step_s",
            "records",
            "exact",
        )
    }
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors()) if rank == 0 else 0
    record_bytes = sum(p.numel() * p.element_size() for p in params)
    for _rep in range(reps + 1):  # the first repetition warms connections and allocations up, and is dropped
        keep = _rep > 0
        # steady steps of the survivor alone
        steady = [train_step() for _ in range(5)] if rank == 0 else []
        # full: the whole state at the entry step, the survivor waiting
        dist.barrier()
        t0 = time.perf_counter()
        send_state(snapshot() if rank == 0 else None, None)
        full_s = time.perf_counter() - t0
        box = [(full_s, median(steady) if steady else 0.0)]
        dist.broadcast_object_list(box, src=0)
        full_s, step_s = box[0]
        plan = plan_entry(
            copy_step=step[0],
            copy_s=full_s,
            step_s=step_s,
            state_bytes=state_bytes,
            record_bytes=record_bytes,
            max_records=MAX_RECORDS,
        )
        if plan.kind is not EntryKind.REPLAY:
            raise SystemExit(f"catch_up: the copy ({full_s:.3f} s) is more than {MAX_RECORDS} steps of {step_s:.3f} s")
        # replay: the copy of step s taken and sent beside step s + 1, then the records as they are made
        dist.barrier()
        if rank == 0:
            copied = threading.Event()
            records: queue.Queue[StepDelta | None] = queue.Queue()

            def sender(records: queue.Queue[StepDelta | None], copied: threading.Event) -> None:
                skeleton, at, tensors = snapshot()  # read-only until step s + 1's optimizer step
                held = (skeleton, at, [t.clone() for t in tensors])
                copied.set()
                send_state(held, side)
                while True:
                    delta = records.get()
                    send_record(delta, side)
                    if delta is None:
                        return

            log = DeltaLog(optimizer, since_step=step[0], max_steps=MAX_RECORDS + 1, step_of=lambda: step[0] + 1)
            thread = threading.Thread(target=sender, args=(records, copied), name="catch-up-sender")
            thread.start()
            heal = [train_step(copied.wait)]  # s + 1: its optimizer step waits for the copy
            records.put(log.deltas[-1])
            for _ in range(plan.records - 1):  # up to the entry step T
                heal.append(train_step())
                records.put(log.deltas[-1])
            # T + 1: the joiner enters at the all-reduce, contributing no samples, before it has replayed T; T + 2:
            # it has replayed T and applied T + 1 (whose gradient it got from that all-reduce, sent here as a record)
            for _ in range(2):
                heal.append(train_step(lambda: dist.barrier()))
                records.put(log.deltas[-1])
            records.put(None)
            thread.join()
            log.close()
            if keep:
                extra = [h - step_s for h in heal]
                for key, value in (
                    ("full_s", full_s),
                    ("replay_pause_s", max(0.0, sum(extra))),
                    ("copy_step_extra_s", extra[0]),
                    ("entry_step_extra_s", extra[-2]),
                    ("caught_up_step_extra_s", extra[-1]),
                    ("steady_step_s", step_s),
                    ("heal_step_s", median(heal)),
                    ("records", plan.records),
                ):
                    samples[key].append(value)
        else:

            def catch_up(records: int) -> None:
                for _ in range(records):
                    delta = send_record(None, side)
                    if delta is None:
                        raise SystemExit("catch_up: the survivor ended the records early")
                    step[0] = replay(optimizer, [delta], at_step=step[0])

            send_state(None, side)
            catch_up(plan.records - 1)  # s + 1 .. T - 1, while the survivor trains
            dist.barrier()  # in the group, at step T + 1's all-reduce
            catch_up(2)  # T, then T + 1
            dist.barrier()  # step T + 2's all-reduce
            catch_up(1)
            if send_record(None, side) is not None:
                raise SystemExit("catch_up: the survivor sent more records than planned")
        same = exact()
        if rank == 0 and keep:
            samples["exact"].append(same)
    if rank == 0:
        out.write_text(
            json.dumps({"state_bytes": state_bytes, "record_bytes": record_bytes, "layers": layers, **samples})
        )
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- driver side


def plot(data: dict, path: Path) -> None:
    plot_repetitions(
        path,
        [
            ([1e3 * t for t in data["full_s"]], "s--", "full state at the entry (today)"),
            ([1e3 * t for t in data["replay_pause_s"]], "o-", "copy in the background + step records"),
        ],
        ylabel="survivor's pause, ms",
        title=f"A joiner catching up on {data['state_bytes'] / 2**20:.0f} MB (gloo, loopback)",
    )


def main(argv: list[str] | None = None) -> int:
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state-mb", type=int, default=None, help="parameters + AdamW state, MB (default by mode)")
        p.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "FILE"), help=argparse.SUPPRESS)
        p.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)

    ns = parse_args(__doc__.splitlines()[0], add_arguments=options, argv=argv)
    state_mb, reps = ns.state_mb or STATE_MB[ns.mode], ns.reps or REPS[ns.mode]
    if state_mb < 1 or reps < 1:
        raise SystemExit(f"catch_up.py: --state-mb and the repetitions must be >= 1, got {state_mb}, {reps}")
    if ns.worker:
        rank, port, file = ns.worker
        code = worker_main(int(rank), 2, int(port), state_mb, reps, Path(file))
        exit_worker(code)
    result = BenchmarkResult(
        name=NAME,
        mode=ns.mode,
        tag=result_tag(ns),
        params={"state_mb": state_mb, "reps": reps, "width": WIDTH, "batch": BATCH, "backend": "gloo", "ranks": 2},
        baseline="today's hydration: the whole state sent at the entry step while the survivor waits, same processes, interleaved",
        notes=[
            "Loopback gloo on 2 CPU cores: the background copy, the joiner's replay and the survivor's step share them.",
            "The group switch at the entry (13-30 ms here) is paid by both variants and not measured.",
            "One survivor, one joiner, a replicated model; not wired into ElasticTraining's joins yet.",
        ],
    )
    args = ["--state-mb", str(state_mb), "--reps", str(reps)]
    data = run_rank_workers(__file__, args, ranks=2, raw=ns.out / f"{NAME}_{ns.mode}.raw.json", timeout_s=900.0)
    full, pause = median(data["full_s"]), median(data["replay_pause_s"])
    summary = {
        "state_mb": round(data["state_bytes"] / 2**20, 1),
        "record_mb": round(data["record_bytes"] / 2**20, 1),
        "full_pause_s": round(full, 4),
        "replay_pause_s": round(pause, 4),
        "replay_copy_step_extra_s": round(median(data["copy_step_extra_s"]), 4),
        "replay_entry_step_extra_s": round(median(data["entry_step_extra_s"]), 4),
        "replay_caught_up_step_extra_s": round(median(data["caught_up_step_extra_s"]), 4),
        "pause_ratio": round(pause / full, 3),
        "pause_ratio_per_rep": [round(p / f, 3) for p, f in zip(data["replay_pause_s"], data["full_s"])],
        "records": data["records"],
        "heal_step_slowdown": round(median(data["heal_step_s"]) / median(data["steady_step_s"]), 3),
        "exact": all(data["exact"]) and len(data["exact"]) == reps,
    }
    result.samples, result.summary = data, summary
    plot(data, result.plot_path(ns.out))
    path = result.write(ns.out)
    print(
        format_table(
            ["state MB", "full pause s", "replay pause s", "ratio", "records", "heal step slowdown", "exact"],
            [
                [
                    summary["state_mb"],
                    summary["full_pause_s"],
                    summary["replay_pause_s"],
                    summary["pause_ratio"],
                    summary["records"],
                    summary["heal_step_slowdown"],
                    summary["exact"],
                ]
            ],
        )
    )
    print(f"wrote {path}")
    return 0 if summary["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
