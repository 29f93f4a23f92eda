"""torchft as a peer in scale events: a replica group joins and leaves a running job; the survivors' pause.

torchft (``pip install -e .[torchft]``, torchft 0.2.0) keeps training while the set of
replica groups changes: a joiner heals from a live peer, a lost group is dropped at the
next quorum. This runs its model loop (``Manager``: ``start_quorum``, one fault-tolerant
gradient all-reduce and ``should_commit`` per step) on the example's tiny Llama with
synthetic tokens, one rank per replica group, gloo, a fixed step time like
``scale_events.py``, its own lighthouse:

    group 0 starts (never stopped)
    join    group 1 starts                      participants 1 -> 2
    leave   group 1 gets SIGTERM (torchft has no graceful leave: the process dies)   2 -> 1

repeated ``cycles`` times. Everything (lighthouse, managers, stores: torchft binds them on
all interfaces) runs inside a fresh network namespace (``unshare -rn``) holding only its own
loopback, so nothing listens where anyone else could reach it.

Measured on group 0 (the survivor), per event: ``pause_s`` = the time its steps took beyond
a normal step between the event and its first committed step with the new participant
count; ``steps_lost`` = steps it did not commit in that window; ``to_new_s`` = event to that
step. ``scale_events.py`` calls :func:`measure` when torchft is importable; alone:

    python benchmarks/torchft_peer.py [--quick | --smoke]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    BenchmarkError,
    BenchmarkResult,
    ManagedProcess,
    OutputBus,
    bench_env,
    format_table,
    median,
    parse_args,
    pyplot,
    read_metrics,
    result_tag,
)

NAME = "torchft_peer"
CYCLES = {"smoke": 1, "quick": 2, "full": 4}
SETTLE_STEPS = {"smoke": 3, "quick": 5, "full": 6}
STEP_TIME_S = 0.5
HEARTBEAT_TIMEOUT_MS = 3000  # like scale_events' lease ttl of 3 s
EVENT_TIMEOUT_S = 90.0
SEQ_LEN, BATCH = 128, 4  # scale_events' per-step work: global batch 4 x 128 tokens


def available() -> bool:
    return importlib.util.find_spec("torchft") is not None


# --------------------------------------------------------------------------- pure analysis


def survivor_pause(records: list[dict[str, Any]], *, t_event: float, participants: int) -> dict[str, Any] | None:
    """What one membership change cost the survivor, from its step log; None until it has happened.

    ``records``: (ts = step end, step, participants, committed). The window runs from the
    last step before ``t_event`` to the first committed step with ``participants``.
    """
    before = [r for r in records if r["ts"] <= t_event]
    after = [r for r in records if r["ts"] > t_event]
    first = next((i for i, r in enumerate(after) if r["participants"] == participants and r["committed"]), None)
    if not before or first is None:
        return None
    tail = before[-7:]
    steady = [b["ts"] - a["ts"] for a, b in zip(tail, tail[1:])]
    normal = median(steady) if steady else STEP_TIME_S
    window = [before[-1], *after[: first + 1]]
    excess = sum(max(0.0, b["ts"] - a["ts"] - normal) for a, b in zip(window, window[1:]))
    return {
        "pause_s": excess,
        "longest_step_s": max(b["ts"] - a["ts"] for a, b in zip(window, window[1:])),
        "step_interval_s": normal,
        "steps_lost": sum(1 for r in after[: first + 1] if not r["committed"]),
        "to_new_s": after[first]["ts"] - t_event,
    }


# --------------------------------------------------------------------------- one replica group


def replica_main(args: argparse.Namespace) -> int:
    """One replica group (one rank): train the tiny Llama under a torchft Manager, log every step."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    sys.path.insert(0, str(REPO_ROOT / "examples" / "llama_finetune"))
    from model import PRESETS, Llama

    torch.set_num_threads(1)
    model = Llama(PRESETS["tiny"])
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{args.replica}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        hostname="127.0.0.1",
    )
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(args.replica)
    with open(args.metrics, "a", buffering=1) as log:
        while True:
            t0 = time.perf_counter()
            manager.start_quorum()
            optimizer.zero_grad()
            tokens = torch.randint(0, 256, (BATCH, SEQ_LEN + 1), generator=generator)
            out = model(tokens[:, :-1], labels=tokens[:, 1:])
            (out.loss.loss_sum / out.loss.num_tokens).backward()
            # One fault-tolerant all-reduce of every gradient (averaged over the participants). Not
            # torchft's DistributedDataParallel: its comm hook fails an assertion when a peer dies
            # mid-step on gloo (torchft 0.2.0), where the manager's allreduce records the error.
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in params])):
                p.grad.copy_(g)
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            time.sleep(max(0.0, args.step_time - (time.perf_counter() - t0)))
            record = {
                "ts": time.time(),
                "step": manager.current_step(),
                "committed": committed,
                "participants": manager.num_participants(),
            }
            log.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------- the scenario, in its namespace


def inside_main(args: argparse.Namespace) -> int:
    """Run the lighthouse and the groups through the cycles; write ``<work>/result.json``."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    from torchft.coordination import LighthouseServer

    work = Path(args.work)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS
    )
    bus = OutputBus()
    groups: dict[int, ManagedProcess] = {}
    events: list[dict[str, Any]] = []
    metrics = work / "group0.jsonl"
    env = bench_env(OMP_NUM_THREADS="1")

    def start(replica: int) -> None:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--replica",
            str(replica),
            "--lighthouse",
            lighthouse.address(),
            "--metrics",
            str(work / f"group{replica}.jsonl"),
            "--step-time",
            str(args.step_time),
        ]
        groups[replica] = ManagedProcess(
            cmd, name=f"group{replica}", env=env, bus=bus, log_path=work / f"group{replica}.log"
        )

    def settled(participants: int) -> None:
        def ready(_: object) -> bool:
            if groups[0].poll() is not None:
                raise BenchmarkError(f"torchft group 0 exited {groups[0].poll()}:\n{groups[0].tail(15)}")
            tail = read_metrics(metrics)[-args.settle :]
            return len(tail) == args.settle and all(r["participants"] == participants and r["committed"] for r in tail)

        bus.wait_for(ready, timeout=EVENT_TIMEOUT_S, what=f"torchft: {args.settle} steps with {participants} group(s)")

    failure = None
    try:
        start(0)
        settled(1)
        for cycle in range(args.cycles):
            for kind, participants in (("join", 2), ("leave", 1)):
                t_event = time.time()
                if kind == "join":
                    start(1)
                else:
                    groups.pop(1).signal(signal.SIGTERM)
                settled(participants)
                measured = survivor_pause(read_metrics(metrics), t_event=t_event, participants=participants)
                events.append({"cycle": cycle, "kind": kind, "t_event": t_event, **(measured or {})})
    except BenchmarkError as e:
        failure = str(e)
    finally:
        for group in groups.values():
            group.close()
        lighthouse.shutdown()
    (work / "result.json").write_text(json.dumps({"events": events, "failure": failure}))
    return 0


def measure(mode: str, work: Path, *, timeout: float = 900.0) -> dict[str, Any]:
    """The torchft scenario of ``mode``, in its own network namespace; events, medians and failure."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [
        "unshare",
        "--user",
        "--map-root-user",
        "--net",
        sys.executable,
        str(Path(__file__).resolve()),
        "--inside",
        "--work",
        str(work),
        "--cycles",
        str(CYCLES[mode]),
        "--settle",
        str(SETTLE_STEPS[mode]),
        "--step-time",
        str(STEP_TIME_S),
    ]
    done = subprocess.run(cmd, env=bench_env(), capture_output=True, text=True, timeout=timeout, check=False)
    result_path = work / "result.json"
    if done.returncode != 0 or not result_path.is_file():
        raise BenchmarkError(f"the torchft scenario exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(result_path.read_text())
    summary: dict[str, Any] = {}
    for kind in ("join", "leave"):
        evs = [e for e in result["events"] if e["kind"] == kind and "pause_s" in e]
        for key in ("pause_s", "longest_step_s", "steps_lost", "to_new_s"):
            summary.setdefault(kind, {})[f"{key.removesuffix('_s')}_median{'_s' if key.endswith('_s') else ''}"] = (
                median(e[key] for e in evs) if evs else None
            )
        summary[kind]["n"] = len(evs)
    return {
        "version": _torchft_version(),
        "params": {
            "cycles": CYCLES[mode],
            "step_time_s": STEP_TIME_S,
            "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            "join_timeout_ms": 100,
            "seq_len": SEQ_LEN,
            "batch": BATCH,
            "model": "tiny",
        },
        "summary": summary,
        **result,
    }


def _torchft_version() -> str:
    from importlib.metadata import version

    return version("torchft")


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        for flag in ("--replica", "--cycles", "--settle"):
            parser.add_argument(flag, type=int, help=argparse.SUPPRESS)
        for flag in ("--lighthouse", "--metrics", "--work"):
            parser.add_argument(flag, help=argparse.SUPPRESS)
        parser.add_argument("--step-time", type=float, default=STEP_TIME_S, help=argparse.SUPPRESS)
        parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)

    args = parse_args(__doc__.splitlines()[0], add_arguments=add, argv=argv)
    if args.replica is not None:
        return replica_main(args)
    if args.inside:
        return inside_main(args)
    if not available():
        print(f"{NAME}: torchft is not installed (pip install -e .[torchft]): skipped")
        return 0
    result = BenchmarkResult(
        name=NAME,
        mode=args.mode,
        tag=result_tag(args),
        params={"torchft": CYCLES[args.mode]},
        baseline="none: torchft is the peer; scale_events.py compares it with hyperpodrun",
    )
    peer = measure(args.mode, args.out / "work" / NAME)
    result.params, result.summary, result.samples = peer["params"], peer["summary"], {"events": peer["events"]}
    result.notes.append(f"torchft {peer['version']}")
    if peer["failure"]:
        result.notes.append(f"the torchft scenario stopped: {peer['failure']}")
        print(f"{NAME}: the torchft scenario stopped: {peer['failure'].splitlines()[0]}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, kind in enumerate(("join", "leave")):
        pauses = [e.get("pause_s", 0) for e in peer["events"] if e["kind"] == kind]
        ax.plot(range(1, len(pauses) + 1), pauses, "os"[i], label=kind)
    ax.set_xlabel("cycle")
    ax.set_ylabel("survivor pause, s")
    ax.legend()
    fig.savefig(result.plot_path(args.out), dpi=120)
    plt.close(fig)
    path = result.write(args.out)
    rows = [
        (e["kind"], e.get("pause_s"), e.get("longest_step_s"), e.get("steps_lost"), e.get("to_new_s"))
        for e in peer["events"]
    ]
    print(format_table(["event", "pause s", "longest step s", "steps lost", "to new size s"], rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
