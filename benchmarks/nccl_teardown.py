"""NCCL teardown: sequential vs concurrent (one thread per backend) shutdown/abort, with 1 and 4 communicators."""

import json
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
backend = "nccl" if dev.type == "cuda" else "gloo"
if dev.type == "cuda":
    torch.cuda.set_device(dev)


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rnd(op, concurrent, n_sub):
    store = dist.TCPStore("127.0.0.1", port(), 1, True, timedelta(seconds=30), wait_for_workers=False)
    dist.init_process_group(
        backend,
        store=store,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
        device_id=dev if dev.type == "cuda" else None,
    )
    x = torch.ones(1 << 16, device=dev)
    dist.all_reduce(x)
    groups = [dist.group.WORLD]
    for _ in range(n_sub):
        g = dist.new_group([0])
        dist.all_reduce(x, group=g)
        groups.append(g)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    bes = [g._get_backend(dev) for g in groups]
    each = [None] * len(bes)

    def one(i):
        t = time.perf_counter()
        getattr(bes[i], op)() if hasattr(bes[i], op) else bes[i].abort()
        each[i] = round(time.perf_counter() - t, 3)

    t0 = time.perf_counter()
    if concurrent:
        ths = [threading.Thread(target=one, args=(i,)) for i in range(len(bes))]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    else:
        for i in range(len(bes)):
            one(i)
    t1 = time.perf_counter()
    dist.destroy_process_group()
    t2 = time.perf_counter()
    return {
        "op": op,
        "concurrent": concurrent,
        "comms": len(bes),
        "total_s": round(t1 - t0, 3),
        "each_s": each,
        "destroy_after_s": round(t2 - t1, 3),
    }


rows = []
rnd("shutdown", False, 0)
for op in ("shutdown", "abort"):
    for concurrent in (False, True):
        for n_sub in (0, 3):
            try:
                rows.append(rnd(op, concurrent, n_sub))
            except Exception as exc:  # noqa: BLE001
                rows.append({"op": op, "concurrent": concurrent, "error": repr(exc)[:300]})
# the Python-level APIs, with 3 subgroups: does _abort_process_group / destroy_process_group overlap them?
for api in ("destroy", "abort_pg"):
    store = dist.TCPStore("127.0.0.1", port(), 1, True, timedelta(seconds=30), wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=dev if dev.type == "cuda" else None)
    subs = [dist.new_group([0]) for _ in range(3)]
    for g in [None, *subs]:
        dist.all_reduce(torch.ones(4, device=dev), group=g)
    t = time.perf_counter()
    dist.destroy_process_group() if api == "destroy" else dist.distributed_c10d._abort_process_group()
    rows.append({"api": api, "comms": 4, "total_s": round(time.perf_counter() - t, 3)})
json.dump({"torch": torch.__version__, "rows": rows}, open(sys.argv[1], "w"), indent=1)
for r in rows:
    print(r)
