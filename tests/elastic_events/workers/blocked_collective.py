"""One of two gloo ranks for the repair-watch test: rank 1 blocks in a collective that rank 0 never joins.

argv: RUN_DIR RANK CONTROL_FILE HOW. Rank 0 stays alive and holds its end of the group (a peer that
left the broken group) until rank 1 has a result. HOW forms round 1's group: ``tracked`` (as a round
engine does: torch's call under abort.forming) or ``init_process_group`` (elastic_events'
call, what a script makes; HYPERPODRUN_ROUND names the round). Rank 1 writes RUN_DIR/result.json:
how long its all_reduce waited and what it raised. Both run a Watchdog on the control channel, so a
repair event the test publishes must end rank 1's wait long before the group's 60 s timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import elastic_events
from elastic_events.control import ControlReader
from elastic_events.rounds import abort
from elastic_events.rounds.watchdog import GlooAbort, Watchdog

GROUP_TIMEOUT = timedelta(seconds=60)


def main() -> int:
    run, rank, control, how = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    port_file = run / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, GROUP_TIMEOUT, wait_for_workers=False)
        (run / "port.tmp").write_text(str(store.port))
        os.replace(run / "port.tmp", port_file)
    else:
        deadline = time.monotonic() + 60
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), 2, False, GROUP_TIMEOUT)
    if how == "tracked":
        with abort.forming(1):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=GROUP_TIMEOUT)
    else:
        elastic_events.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=GROUP_TIMEOUT)
    broken: list[str] = []
    watch = Watchdog(
        ControlReader(control, rank), abort=GlooAbort(), on_broken=lambda _, why: broken.append(why)
    ).start()
    (run / f"ready-{rank}").touch()
    result = run / "result.json"
    if rank == 0:
        deadline = time.monotonic() + 90
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            outcome = {"raised": False}
        except RuntimeError as exc:
            # what RoundEngine.peer_failure looks for: the round marked broken, or a connection a peer closed
            evidence = time.monotonic() + 5
            while not (broken or abort.peer_closed(1)) and time.monotonic() < evidence:
                time.sleep(0.01)
            outcome = {"raised": True, "round_broken": bool(broken) or abort.peer_closed(1), "error": str(exc)[:300]}
        outcome["seconds"] = time.monotonic() - t0
        (run / "result.tmp").write_text(json.dumps(outcome))
        os.replace(run / "result.tmp", result)
    watch.stop()
    sys.stdout.flush()
    os._exit(0)  # the group is broken on purpose: skip gloo's teardown at exit


if __name__ == "__main__":
    raise SystemExit(main())
