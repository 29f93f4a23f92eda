#!/usr/bin/env bash
# hyperpodrun GPU check: what one CUDA GPU can show of the NCCL/CUDA paths, in at most ~8 minutes.
#
#   cd <hyperpodrun checkout>            # the repository root
#   OUT=/some/dir bash gpu_check.sh      # results: $OUT/summary.json, $OUT/summary.txt, one log per part
#
# Needs Python >= 3.10 with torch==2.13.0 (CUDA build: `pip install torch==2.13.0` pulls the CUDA wheels)
# and `pip install -e .`; when they are missing the script installs them (INSTALL=0 to forbid), inside the
# same time budget. No internet is needed otherwise (the example's corpus ships with CPython).
#
# Parts, in priority order (each under its own `timeout`; a global budget skips what no longer fits):
#   info  versions, GPU, /dev/shm
#   A     the example (tiny) on cuda + NCCL at world 1 under hyperpodrun: DCP async checkpoints from GPU,
#         the spare rank (does it touch the GPU?), the rank's TORCH_NCCL_ASYNC_ERROR_HANDLING
#   A2    resume of A's run from its DCP checkpoint onto the GPU
#   E     does prewarm() (what spares and parked ranks import) initialise CUDA?
#   K     the example (tiny) on cuda + NCCL, one rank per GPU (2 at most) forked from the node's fork server
#         (--start-method forkserver): does every rank fork (no fallback line: the server must not initialise
#         the CUDA driver)?
#   B1    one process, NCCL world 1: 20 rounds formed/used/destroyed as hyperpodrun forms them (eager init
#         bound to the device, split subgroup, gloo side group, DDP, broadcast_tensors), then 10 rounds torn
#         down by _abort_process_group (the recover() path) and re-formed: time per round, leaks;
#         the host/device ordering hazard of a stuck collective
#   B1a   abort from another thread while the main thread is blocked in a CUDA sync, then the aborted group
#         used again and a new round formed; with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (hyperpodrun's) and =0
#   B2    in-memory snapshots (elastic_events.rounds.snapshot.Replicator) of a 190M-parameter Llama + fused AdamW on
#         the GPU: 2 ranks share the GPU over gloo; copies checked bit for bit; step time without / every
#         step / every 5th; D2H bandwidth pageable vs pinned; pinned memory held
#   O     HSDP's copy one step back (benchmarks/own_copy.py --quick): a ~2 GB local state copied to pinned host
#         memory every step, after the optimizer step beside the next forward/backward (the product's way)
#         against in the pre-step hook (the optimizer waits for it) and no copy; each copy checked
#   C3/C1/C4  llama3.2-1b (the example's largest preset that fits one GPU), DDP world 1: tokens/s under
#         hyperpodrun (API live), a bare loop without hyperpodrun's API, and torchrun (API inert)
#   D     llama3.2-1b with --fsdp (FSDP2 on CUDA) under hyperpodrun: tokens/s
#   H     the example (tiny) with --hsdp on cuda + NCCL at world 1 under hyperpodrun: the ("replicate", "shard")
#         mesh built on the CUDA device, FSDP2 on it, a DCP checkpoint of the sharded state
#   H3/H5/H4 llama3.2-1b with --hsdp: tokens/s under hyperpodrun, the same without the commit check, and under
#         torchrun (issue 26's overhead, world 1)
#   F     --deterministic-reduce on CUDA (deterministic algorithms + SDPA)
#   G     how long a SIGKILLed process's GPU memory takes to come back (a replacement rank on the same GPU)
set -uo pipefail

START=$(date +%s)
BUDGET_S=${BUDGET_S:-450}          # all parts together; the last one is cut to what is left (+10 s kill grace)
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ ! -f examples/llama_finetune/train.py ] || [ ! -d src/elastic_events ]; then
  echo "gpu_check.sh: run it from the hyperpodrun repository root" >&2; exit 2
fi
REPO=$PWD
TRAIN=$REPO/examples/llama_finetune/train.py
WORK=$(mktemp -d -t hpr-gpucheck.XXXXXX)
export PY OUT WORK TRAIN REPO
export PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN} TOKENIZERS_PARALLELISM=false
PARTS="$OUT/parts.tsv"
printf 'part\tstatus\trc\tseconds\tlimit\n' > "$PARTS"
: > "$OUT/commands.txt"

left() { echo $(( START + BUDGET_S - $(date +%s) )); }

sweep() {  # end what this check started and left behind: every process whose command line names $WORK
  local p
  for p in $(pgrep -f -- "$WORK" 2>/dev/null); do
    [ "$p" != "$$" ] && kill -9 "$p" 2>/dev/null
  done
  return 0
}
trap 'sweep; cp -r "$WORK"/logs-* "$OUT/" 2>/dev/null; rm -rf "$WORK"' EXIT

run_part() {  # NAME LIMIT_S MIN_S CMD... : run CMD under `timeout` unless less than MIN_S of budget is left
  local name=$1 limit=$2 min=$3; shift 3
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  local remain; remain=$(left)
  if (( remain < min )); then
    printf '%s\tSKIPPED\t-\t0\t%s\n' "$name" "$limit" >> "$PARTS"
    echo "[$name] skipped (${remain}s of the budget left, needs ${min}s)"
    return 0
  fi
  (( limit > remain )) && limit=$remain
  echo "$name: $*" >> "$OUT/commands.txt"
  rm -rf "$OUT/$name".* "$OUT/${name}"_*  # an earlier run's files in the same OUT (metrics append)
  echo "[$name] running, limit ${limit}s ..."
  local t0 rc dt status
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  sweep
  case $name in C?|D|H?) rm -rf "$WORK/run-$name" ;; esac  # a 1B run's final checkpoint is ~15 GB of the disk
  if (( rc == 0 )); then status=PASS; elif (( rc == 124 || rc == 137 )); then status=TIMEOUT; else status=FAIL; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$dt" "$limit" >> "$PARTS"
  echo "[$name] $status (rc $rc, ${dt}s)"
}

mkdir -p "$WORK/py" "$WORK/data"

# ----------------------------------------------------------------------------------------- helpers (Python)

cat > "$WORK/py/info.py" <<'EOF'
"""Versions, the GPU, /dev/shm; exit 3 when torch has no CUDA or the project is not importable."""
import json, os, platform, shutil, subprocess, sys

info = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        v = torch.cuda.nccl.version()
        info.update(gpu=p.name, gpu_mem_gb=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                    device_count=torch.cuda.device_count(), nccl=".".join(map(str, v)) if isinstance(v, tuple) else str(v))
except Exception as exc:  # noqa: BLE001
    info["torch_error"] = repr(exc)
for mod in ("elastic_events", "hyperpodrun", "torchdata", "psutil"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "ok")
    except Exception as exc:  # noqa: BLE001
        info[mod] = f"MISSING: {exc}"
try:
    info["dev_shm_free_gb"] = round(shutil.disk_usage("/dev/shm").free / 2**30, 1)
    info["host_mem_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
except (OSError, ValueError):
    pass
try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as exc:  # noqa: BLE001
    info["nvidia_smi"] = repr(exc)
info["env"] = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "CUDA_VISIBLE", "PYTORCH_"))}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
ok = info.get("cuda_available") and not any(str(info.get(m, "")).startswith("MISSING") for m in ("elastic_events", "hyperpodrun", "torchdata", "psutil"))
sys.exit(0 if ok else 3)
EOF

cat > "$WORK/py/poll.py" <<'EOF'
"""Twice a second until STOP exists: this check's processes (their command line names WORK) and what they
hold of the GPU (nvidia-smi's compute apps, /dev/nvidiaN descriptors, libcuda mapped); ranks' NCCL settings."""
import json, os, subprocess, sys, time
import psutil

work, out, stop = sys.argv[1], sys.argv[2], sys.argv[3]


def gpu_apps():
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=5)
        apps = {}
        for line in r.stdout.strip().splitlines():
            pid, mem = (x.strip() for x in line.split(",")[:2])
            apps[int(pid)] = float(mem)
        return apps
    except Exception:  # noqa: BLE001
        return None


def kind(cmd):
    s = " ".join(cmd)
    if "elastic_events.rounds.spare" in s:
        return "spare"
    if "-m hyperpodrun" in s:
        return "launcher"
    if "train.py" in s:
        return "rank"
    return "other"


samples = []
while not os.path.exists(stop):
    apps = gpu_apps()
    rows = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.pid == os.getpid() or not any(work in c for c in cmd):
            continue
        row = {"pid": p.pid, "kind": kind(cmd)}
        try:
            devs = set()
            for fd in os.listdir(f"/proc/{p.pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/nvidia") and target[11:].isdigit():
                    devs.add(target)
            row["gpu_device_fds"] = sorted(devs)
            with open(f"/proc/{p.pid}/maps") as f:
                row["libcuda_mapped"] = "libcuda.so" in f.read()
            if row["kind"] == "rank":
                env = p.environ()
                row["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
                row["LOCAL_RANK"] = env.get("LOCAL_RANK")
        except (psutil.Error, OSError):
            pass
        if apps is not None:
            row["gpu_mem_mb"] = apps.get(p.pid)
        rows.append(row)
    samples.append({"t": time.time(), "gpu_apps": None if apps is None else len(apps), "procs": rows})
    time.sleep(0.5)
json.dump(samples, open(out, "w"))
EOF

cat > "$WORK/py/prewarm_check.py" <<'EOF'
"""What a spare or a parked rank does before it has a GPU: import torch, elastic_events.rounds.spare, prewarm(). CUDA untouched?"""
import json, os, subprocess, sys, time


def libcuda_mapped():
    with open("/proc/self/maps") as maps:
        return any("libcuda.so" in line for line in maps)


res = {"libcuda_mapped_at_start": libcuda_mapped()}
import torch  # noqa: E402
import torch.distributed  # noqa: F401,E402

res["libcuda_mapped_after_import_torch"] = libcuda_mapped()
t = time.perf_counter()
import elastic_events.rounds.spare  # noqa: F401,E402
from elastic_events.rounds.joining import prewarm  # noqa: E402
prewarm()
res["imports_and_prewarm_s"] = round(time.perf_counter() - t, 2)
res["cuda_initialized_after_prewarm"] = torch.cuda.is_initialized()
res["libcuda_mapped_after_prewarm"] = libcuda_mapped()
from elastic_events.rounds.forkserver import accelerator_initialised  # noqa: E402

res["driver_initialised_after_prewarm"] = accelerator_initialised()  # the fork server's test: False lets it fork


def listed():
    time.sleep(1.0)
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=10)
    mine = [line for line in r.stdout.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
    return mine[0].split(",")[1].strip() + " MiB" if mine else None


res["on_gpu_after_prewarm"] = listed()
# The example's parked joiner calls torch.cuda.set_device(LOCAL_RANK) at its first line: a context while parked?
torch.cuda.set_device(0)
res["on_gpu_after_set_device"] = listed()
torch.zeros(1, device="cuda")
res["on_gpu_after_first_tensor"] = listed()
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res, indent=1))
EOF

cat > "$WORK/py/nccl_cycle.py" <<'EOF'
"""NCCL process groups formed, used and torn down in one process the way hyperpodrun's rounds are (world 1).

cycles: GRACEFUL rounds ended by destroy_process_group (a scale event), then BROKEN rounds ended by
  _abort_process_group (recover()), each round using what a real round uses: eager NCCL init bound to the
  device (init_round_group), a split subgroup (hydration), a gloo side group (snapshots), DDP, broadcast_tensors.
  Reports per-round times and what grows. Then the host/device hazard: optimizer.step() returns on the host
  while a collective queued before it has not run (a GPU delay stands in for a peer that never arrives).
abort_blocked: a collective queued behind 3 s of GPU work, the main thread blocked in .item(), another thread
  aborts the group (what a repair watch for NCCL would do); then the aborted group object is used again (as
  DDP's reducer would) and a new round is formed in the same process.
"""
import argparse, gc, json, os, socket, statistics, sys, threading, time, traceback, weakref

import torch
import torch.distributed as dist

from elastic_events.contract import GroupAssignment
from elastic_events.rounds.group import RoundSpec, init_round_group, teardown_group
from elastic_events.rounds.transfer import broadcast_tensors

DEV = torch.device("cuda", 0)
torch.cuda.set_device(DEV)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usage():
    free, total = torch.cuda.mem_get_info(DEV)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"gpu_used_mb": round((total - free) / 2**20), "torch_reserved_mb": round(torch.cuda.memory_reserved(DEV) / 2**20),
            "rss_mb": round(rss / 2**20), "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


def form(rnd):
    one = GroupAssignment(group_rank=0, group_world_size=1, nproc_per_node=1, master_addr="127.0.0.1",
                          master_port=free_port())
    return init_round_group(RoundSpec(round=rnd, assignment=one, local_rank=0), device=DEV, backend="nccl",
                            timeout_s=60)


def cycles_per_s():
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(1 << 27)
    torch.cuda.synchronize()
    return (1 << 27) / (time.perf_counter() - t)


def save(res, path):
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def cycles(args):
    res = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "rounds": [], "error": None}
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048)).to(DEV)
    step_cpu = torch.tensor(3.0)  # e.g. a non-fused AdamW 'step': a CPU tensor that broadcast_tensors moves through the GPU
    res["before"] = usage()
    for i in range(args.graceful + args.broken):
        broken = i >= args.graceful
        try:
            t0 = time.perf_counter()
            store = form(i)
            t1 = time.perf_counter()
            x = torch.full((1 << 20,), float(i), device=DEV)
            dist.all_reduce(x)
            sub = dist.new_group([0])  # hydration's subgroup: ncclCommSplit of the bound communicator
            dist.broadcast(x, src=0, group=sub)
            side = dist.new_group(backend="gloo")  # the snapshots' / checkpointer's gloo group
            dist.all_reduce(torch.zeros(1), group=side)
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], init_sync=i == 0)
            ddp(torch.randn(64, 2048, device=DEV)).sum().backward()
            broadcast_tensors([*model.parameters(), step_cpu], src=0, device=DEV, bucket_bytes=1 << 20)
            ok = float(x[0].item()) == float(i)
            in_round = usage()["gpu_used_mb"]
            alive = weakref.ref(ddp)
            del ddp
            model.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            teardown_group(broken=broken)
            t3 = time.perf_counter()
            del store, sub, side
            gc.collect()
            res["rounds"].append({"round": i, "broken": broken, "init_s": round(t1 - t0, 4), "use_s": round(t2 - t1, 4),
                                  "teardown_s": round(t3 - t2, 4), "ok": ok, "ddp_freed": alive() is None,
                                  "gpu_used_mb_in_round": in_round, **usage()})
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            res["error"] = f"round {i} ({'after abort' if broken else 'after destroy'}): {type(exc).__name__}: {exc}"[:800]
            break
        save(res, args.out)
    rows = res["rounds"]
    for label, sel in (("graceful", [r for r in rows if not r["broken"]]), ("broken", [r for r in rows if r["broken"]])):
        if len(sel) >= 2:
            a, b = sel[1] if label == "graceful" else sel[0], sel[-1]
            res[label] = {"rounds": len(sel), "init_median_s": statistics.median(r["init_s"] for r in sel),
                          "init_first_s": sel[0]["init_s"], "teardown_median_s": statistics.median(r["teardown_s"] for r in sel),
                          "all_ok": all(r["ok"] for r in sel), "ddp_always_freed": all(r["ddp_freed"] for r in sel),
                          "growth": {k: b[k] - a[k] for k in ("gpu_used_mb", "torch_reserved_mb", "rss_mb", "threads", "fds")},
                          "growth_over_rounds": f"{a['round']}..{b['round']}"}
    save(res, args.out)
    # The ordering hazard: a step whose gradient all-reduce never completes still gets its optimizer step enqueued.
    try:
        store = form(10_000)
        lin = torch.nn.Linear(4096, 4096).to(DEV)
        opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, fused=True)
        ddp = torch.nn.parallel.DistributedDataParallel(lin, device_ids=[0])
        inp = torch.randn(256, 4096, device=DEV)
        ddp(inp).sum().backward(); opt.step(); opt.zero_grad(); torch.cuda.synchronize()
        cps = cycles_per_s()
        t0 = time.perf_counter()
        loss = ddp(inp).sum()
        torch.cuda._sleep(int(2.0 * cps))  # the backward's all-reduce waits 2 s on the GPU (a peer that does not come)
        loss.backward()
        opt.step()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        res["hazard"] = {"host_returned_from_optimizer_step_s": round(host, 4), "device_finished_s": round(time.perf_counter() - t0, 3),
                         "meaning": "the host passed optimizer.step() (and would count the step) long before the device ran the "
                                    "all-reduce the step depends on; an abort in between lets queued optimizer kernels run on partial gradients"}
        del ddp
        teardown_group()
        del store
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        res["hazard"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    save(res, args.out)
    print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=1))
    return 0 if res["error"] is None else 1


def abort_blocked(args):
    res = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    store = form(0)
    pg = dist.group.WORLD
    x = torch.ones(1 << 20, device=DEV)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    cps = cycles_per_s()
    torch.cuda._sleep(int(3.0 * cps))  # the GPU is busy for 3 s
    dist.all_reduce(x)  # queued on NCCL's stream behind it; the current stream waits for it

    def aborter():
        time.sleep(0.5)
        t = time.perf_counter()
        try:
            teardown_group(broken=True)  # what recover() calls: _abort_process_group()
            res["abort"] = "ok"
        except Exception as exc:  # noqa: BLE001
            res["abort"] = f"{type(exc).__name__}: {exc}"[:300]
        res["abort_call_s"] = round(time.perf_counter() - t, 3)

    th = threading.Thread(target=aborter, daemon=True)
    t = time.perf_counter()
    th.start()
    try:
        x[0].item()
        res["main_thread_sync"] = "returned"
    except Exception as exc:  # noqa: BLE001
        res["main_thread_sync"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    res["main_thread_blocked_s"] = round(time.perf_counter() - t, 3)
    th.join(30)
    res["abort_thread_finished"] = not th.is_alive()
    save(res, args.out)
    # The aborted group's object, as a DDP reducer or a snapshot thread still holding it would use it.
    box = {}

    def use_old():
        try:
            pg.allreduce([x]).wait()
            torch.cuda.synchronize()
            box["r"] = "no error: a collective ran on the aborted group (a new communicator? on N ranks it would wait for the others)"
        except Exception as exc:  # noqa: BLE001
            box["r"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    t = time.perf_counter()
    u = threading.Thread(target=use_old, daemon=True)
    u.start()
    u.join(20)
    res["old_group_after_abort"] = box.get("r", "hung for 20 s")
    res["old_group_call_s"] = round(time.perf_counter() - t, 3)
    save(res, args.out)
    t = time.perf_counter()
    try:
        store = form(1)
        y = torch.ones(4, device=DEV)
        dist.all_reduce(y)
        torch.cuda.synchronize()
        res["reform_after_abort"] = "ok" if y[0].item() == 1.0 else f"wrong result {y[0].item()}"
        teardown_group()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        res["reform_after_abort"] = f"{type(exc).__name__}: {exc}"[:400]
    res["reform_s"] = round(time.perf_counter() - t, 3)
    save(res, args.out)
    print(json.dumps(res, indent=1))
    return 0 if res.get("reform_after_abort") == "ok" else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("cycles", "abort_blocked"))
    p.add_argument("--graceful", type=int, default=20)
    p.add_argument("--broken", type=int, default=10)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    sys.exit(cycles(a) if a.mode == "cycles" else abort_blocked(a))
EOF

cat > "$WORK/py/snap_check.py" <<'EOF'
"""In-memory snapshots on the GPU with elastic_events.rounds.snapshot.Replicator, as ElasticTraining drives it.

Two ranks (torchrun --nproc-per-node 2) share the one GPU over a gloo default group (NCCL refuses two ranks
on one device; the snapshots travel over gloo anyway), each training its own Llama + fused AdamW on cuda:0.
Each holds the other's copies. The optimizer's kernels are made to finish 20 ms after the host enqueued them,
so a copy that did not wait for them would read stale bytes: the copies are checked bit for bit against the
live state. Measured: step time without snapshots, with one every step and every 5th step, the chain's
latency, D2H bandwidth (pageable, pinned) and the pinned memory the process holds."""
import argparse, json, os, sys, time, zlib
from datetime import timedelta

sys.path.insert(0, os.path.join(os.getcwd(), "examples", "llama_finetune"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402

from elastic_events.rounds import abort  # noqa: E402
from elastic_events.rounds.snapshot import Piece, Replicator, capture, optimizer_state_count  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--dim", type=int, default=1024)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--micro", type=int, default=4)
args = p.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("gloo", timeout=timedelta(seconds=300))
res = {"rank": rank}

cfg = LlamaConfig.from_name("llama3.2-1b", dim=args.dim, n_layers=args.layers, n_heads=16, n_kv_heads=4,
                            hidden_dim=4 * args.dim, vocab_size=args.vocab, tie_embeddings=False, max_seq_len=max(1024, args.seq))
with torch.device("meta"):
    model = Llama(cfg)
model.to_empty(device=dev)
model.init_weights(seed=rank)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
res["params_m"] = round(cfg.num_params() / 1e6, 1)


def cycles_per_s():
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(1 << 27)
    torch.cuda.synchronize()
    return (1 << 27) / (time.perf_counter() - t)


CPS = cycles_per_s()

def d2h_bandwidth():  # rank 0, alone on the GPU, after the pinned stats were read
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).fill_(7)
    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(1 << 30, dtype=torch.uint8)
    for name, dst in (("pageable", pageable), ("pinned", pinned)):
        dst.copy_(src)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        res[f"d2h_{name}_gb_s"] = round(3 / (time.perf_counter() - t), 1)


sockets = set()
with abort.tracking(sockets):  # as ElasticTraining._side_group makes them
    group = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    acks = dist.new_group(backend="gloo", timeout=timedelta(days=1))
rep = Replicator(group=group, acks=acks, sockets=sockets, round=0, rank=rank, world_size=world, local_world_size=world,
                 bucket_bytes=64 << 20, timeout_s=300)
st = {"captured": capture(model, opt), "wait": 0.0}


def pre_hook(*_):  # ElasticTraining._wait_snapshot: no step before the last snapshot's chain is done
    t = time.perf_counter()
    rep.wait(broken=lambda: None)
    st["wait"] += time.perf_counter() - t


def post_hook(*_):  # ElasticTraining._recapture: the optimizer's state appears at its first step
    if st["captured"].count != optimizer_state_count(opt):
        st["captured"] = capture(model, opt)


opt.register_step_pre_hook(pre_hook)
opt.register_step_post_hook(post_hook)
state = {"step": 0}


def snap():
    c = st["captured"]
    s = state["step"]
    rep.snapshot(Piece(owner=rank, round=0, world_size=world, step=s, layout=c.layout, small={"step": s},
                       param_groups=c.param_groups(opt), tensors=c.tensors))


def train_step():
    x = torch.randint(0, 258, (args.micro, args.seq), device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, x)
    out.loss.loss_sum.backward()
    torch.cuda._sleep(int(0.02 * CPS))  # the optimizer's kernels end 20 ms after the host enqueued them
    opt.step()
    opt.zero_grad(set_to_none=True)
    state["step"] += 1
    return out.loss.loss_sum.detach()


def phase(name, steps, every):
    rep.wait(broken=lambda: None)
    dist.barrier()
    st["wait"], times = 0.0, []
    for _ in range(steps):
        t = time.perf_counter()
        loss = train_step()
        if every and state["step"] % every == 0:
            snap()  # after the step, as elastic_event_detected() does
        loss.item()  # one host sync per step, as the example's token count and logging
        times.append(time.perf_counter() - t)
    rep.wait(broken=lambda: None)
    body = times[1:] if len(times) > 1 else times
    res[f"step_ms_{name}"] = round(1000 * sum(body) / len(body), 1)
    res[f"wait_in_pre_hook_s_{name}"] = round(st["wait"], 3)


def verify(tag):
    """The last snapshot was taken after the last step (no step since): wait for its chain, then compare
    own copy == live bytes, and the holder's copy == the owner's (each step is snapshotted once only: a
    second snapshot of the same step is not waited for by its chain, see Replicator._chain)."""
    rep.wait(broken=lambda: None)
    torch.cuda.synchronize()
    s = state["step"]
    own = rep.held_piece(rank, s)
    live = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in st["captured"].tensors]
    own_equal = all(torch.equal(a, b) for a, b in zip(own.tensors, live))
    mine = [zlib.adler32(v.numpy()) for v in own.tensors]
    held = [zlib.adler32(v.numpy()) for v in rep.held_piece((rank - 1) % world, s).tensors]
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, held))
    holder_equal = everyone[(rank + 1) % world][1] == mine
    res[f"verify_{tag}"] = {"step": s, "own_copy_equals_live": own_equal, "holder_copy_equals_owner": holder_equal}


phase("warmup", 3, 0)
phase("none", 10, 0)
phase("every1", 8, 1)
verify("after_every1")
phase("every5", 15, 5)
lat = []
for _ in range(2):  # the chain alone: a step, then its snapshot and an immediate wait
    train_step().item()
    t = time.perf_counter()
    snap()
    rep.wait(broken=lambda: None)
    lat.append(time.perf_counter() - t)
layout = st["captured"].layout
res["state_gb"] = round(layout.state_bytes / 2**30, 3)
res["chain_s"] = round(min(lat), 3)
res["chain_gb_s"] = round(layout.state_bytes / 2**30 / min(lat), 2)
verify("final")
res["snapshots_completed"] = rep.completed
res["replication_failed"] = None if rep.failed is None else repr(rep.failed)[:300]
res["held_host_gb"] = round(rep.held_bytes() / 2**30, 3)
try:
    hs = torch.cuda.host_memory_stats()
    res["pinned_allocated_gb"] = round(hs.get("allocated_bytes.current", 0) / 2**30, 3)
    res["pinned_active_gb"] = round(hs.get("active_bytes.current", 0) / 2**30, 3)
except Exception as exc:  # noqa: BLE001
    res["pinned_stats_error"] = repr(exc)[:200]
res["gpu_max_allocated_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
res["threads_closed"] = rep.close(timeout_s=60)
dist.barrier()
if rank == 0:
    d2h_bandwidth()
dist.barrier()
everyone = [None] * world
dist.all_gather_object(everyone, res)
if rank == 0:
    s0 = everyone[0]
    summary = {"ranks": everyone,
               "ok": all(r[k][f] for r in everyone for k in ("verify_after_every1", "verify_final")
                         for f in ("own_copy_equals_live", "holder_copy_equals_owner")) and all(r["replication_failed"] is None for r in everyone),
               "step_ms": {k: s0[f"step_ms_{k}"] for k in ("none", "every1", "every5")},
               "overhead_every1": round(s0["step_ms_every1"] / s0["step_ms_none"], 2),
               "overhead_every5": round(s0["step_ms_every5"] / s0["step_ms_none"], 2)}
    json.dump(summary, open(args.out, "w"), indent=1)
    print(json.dumps(summary, indent=1))
dist.destroy_process_group()
EOF

cat > "$WORK/py/pinned_check.py" <<'EOF'
"""Host memory for snapshot copies (elastic_events.rounds.transfer.pinned_empty): pinned at its exact size,
outside the caching host allocator (torch.empty(pin_memory=True) rounds 2.09 GB up to 4 GB and keeps it), and
copied into from the GPU at pinned speed; unpinned when freed."""
import gc, json, sys, time
import torch
from elastic_events.rounds.transfer import pinned_empty

n = int(2.09 * 2**30)
src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(3)
before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
flat = pinned_empty(n)
res = {"bytes": n, "host_allocator_bytes_added": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before}
flat.copy_(src, non_blocking=True)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(3):
    flat.copy_(src, non_blocking=True)
torch.cuda.synchronize()
res["d2h_gb_s"] = round(3 * n / 2**30 / (time.perf_counter() - t), 1)
res["bytes_equal"] = bool(flat[:: 2**20].eq(3).all())
del flat
gc.collect()
again = pinned_empty(n)  # registered again after the unregister: nothing leaked
res["registered_again"] = again.numel() == n
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res))
EOF

cat > "$WORK/py/bare_loop.py" <<'EOF'
"""The example's model, batch and optimizer in a loop with nothing of hyperpodrun (no ElasticTraining, no
sampler, no process group): the baseline for train.py's tokens/s. One host sync per step, like train.py."""
import argparse, json, os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "examples", "llama_finetune"))
import torch  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="llama3.2-1b")
p.add_argument("--seq-len", type=int, default=1024)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--micro-batch", type=int, default=4)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--skip", type=int, default=5)
p.add_argument("--out", required=True)
a = p.parse_args()
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
torch.manual_seed(0)
cfg = LlamaConfig.from_name(a.model)
with torch.device("meta"):
    model = Llama(cfg)
model.to_empty(device=dev)
model.init_weights(seed=0)
decay = [q for q in model.parameters() if q.dim() >= 2]
no_decay = [q for q in model.parameters() if q.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
gen = torch.Generator().manual_seed(0)
tokens_per_step = a.global_batch * a.seq_len
ends = []
for step in range(a.steps):
    loss_sum = torch.zeros((), device=dev)
    for _ in range(a.global_batch // a.micro_batch):
        x = torch.randint(0, 258, (a.micro_batch, a.seq_len), generator=gen).pin_memory().to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, x)
        (out.loss.loss_sum / tokens_per_step).backward()
        loss_sum += out.loss.loss_sum.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_sum.item()
    ends.append(time.perf_counter())
tps = (len(ends) - 1 - a.skip) * tokens_per_step / (ends[-1] - ends[a.skip])
res = {"model": a.model, "tokens_per_s": round(tps), "tokens_per_step": tokens_per_step, "steps": a.steps, "skip": a.skip,
       "gpu_max_allocated_gb": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)}
json.dump(res, open(a.out, "w"), indent=1)
print(json.dumps(res))
EOF

cat > "$WORK/py/kill_release.py" <<'EOF'
"""A process holding half the GPU memory and running a kernel (a rank stuck in a collective) is SIGKILLed, as
the agent kills a stuck rank; how soon can a replacement on the same GPU allocate the same amount?"""
import json, subprocess, sys, time
import torch

torch.cuda.set_device(0)
free0, _ = torch.cuda.mem_get_info(0)
nbytes = int(free0 * 0.45)
child = subprocess.Popen(
    [sys.executable, "-c",
     "import sys, time, torch\n"
     "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); x.fill_(1); torch.cuda.synchronize()\n"
     "torch.cuda._sleep(1 << 42)\n"  # a kernel that runs for many minutes
     "print('ready', flush=True); time.sleep(300)\n", str(nbytes)],
    stdout=subprocess.PIPE, text=True)
res = {"gb": round(nbytes / 2**30, 1), "child_ready": child.stdout.readline().strip() == "ready"}
time.sleep(0.5)
t = time.perf_counter()
child.kill()
child.wait()
res["reaped_s"] = round(time.perf_counter() - t, 3)
got = None
while time.perf_counter() - t < 30:
    try:
        got = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        break
    except torch.OutOfMemoryError:
        time.sleep(0.02)
res["same_size_allocatable_after_s"] = round(time.perf_counter() - t, 3) if got is not None else None
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res))
EOF

cat > "$WORK/py/summarize.py" <<'EOF'
"""summary.json and a compact summary.txt from the parts' JSON, metrics and logs."""
import csv, json, os, re, sys

out = sys.argv[1]


def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


parts = {}
try:
    with open(os.path.join(out, "parts.tsv")) as f:
        parts = {r["part"]: r for r in csv.DictReader(f, delimiter="\t")}
except OSError:
    pass


def status(name):
    r = parts.get(name)
    return "not run" if r is None else r["status"] if r["status"] == "SKIPPED" else f"{r['status']} {r['seconds']}s"


def log_lines(name):
    try:
        with open(os.path.join(out, f"{name}.log"), errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def last_error(name):
    for line in reversed(log_lines(name)):
        if re.search(r"Error|error:|Exception|NCCL WARN|Traceback|Killed|Aborted", line):
            return line.strip()[:220]
    return ""


def tokens_per_s(metrics, tokens_per_step, skip=5):
    try:
        with open(os.path.join(out, metrics)) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    steps = [r for r in recs if r.get("step", 0) > skip][:-1]  # the last step also saves the final checkpoint
    if len(steps) < 2 or steps[-1]["ts"] <= steps[0]["ts"]:
        return None
    return round((steps[-1]["step"] - steps[0]["step"]) * tokens_per_step / (steps[-1]["ts"] - steps[0]["ts"]))


S = {"parts": parts, "info": load("info.json")}
lines = []
info = S["info"] or {}
lines.append(f"hyperpodrun GPU check: {info.get('gpu', '?')} {info.get('gpu_mem_gb', '?')} GB, torch {info.get('torch', '?')} "
             f"(CUDA {info.get('cuda', '?')}), NCCL {info.get('nccl', '?')}, {info.get('cpus', '?')} CPUs")

# A: the example under hyperpodrun, NCCL world 1
a_log = "\n".join(log_lines("A"))
polls = load("A_gpu_procs.json") or []
procs = [p for s in polls for p in s["procs"]]
spares = [p for p in procs if p["kind"] == "spare"]
ranks = [p for p in procs if p["kind"] == "rank"]
pids_on_gpu = {p["pid"] for p in procs if p.get("gpu_mem_mb")}
S["A"] = {"status": status("A"), "done_line": "done:" in a_log,
          "spare_seen": bool(spares), "spare_pid_on_gpu": any(p.get("gpu_mem_mb") for p in spares),
          "spare_gpu_device_fds": sorted({d for p in spares for d in p.get("gpu_device_fds", [])}),
          "spare_libcuda_mapped": any(p.get("libcuda_mapped") for p in spares),
          "rank_TORCH_NCCL_ASYNC_ERROR_HANDLING": next((p.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") for p in ranks if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in p), "?"),
          "max_gpu_processes": max((s["gpu_apps"] or 0 for s in polls), default=None),
          "nvidia_smi_sees_our_pids": bool(pids_on_gpu), "error": last_error("A") if parts.get("A", {}).get("status") != "PASS" else ""}
try:
    with open(os.path.join(out, "A_events.jsonl")) as f:
        kinds = [json.loads(line).get("event") for line in f if line.strip()]
    S["A"]["spare_ready_event"] = "spare_ready" in kinds
except (OSError, ValueError):
    pass
a = S["A"]
lines.append(f"A  example tiny, hyperpodrun, cuda+NCCL w1 : {a['status']}; finished={a['done_line']}; spare started={a['spare_seen']}, "
             f"spare on GPU={a['spare_pid_on_gpu'] or bool(a['spare_gpu_device_fds'])} (fds {a['spare_gpu_device_fds'] or 'none'}, "
             f"nvidia-smi sees pids={a['nvidia_smi_sees_our_pids']}); rank TORCH_NCCL_ASYNC_ERROR_HANDLING={a['rank_TORCH_NCCL_ASYNC_ERROR_HANDLING']}"
             + (f"; {a['error']}" if a["error"] else ""))
a2 = "\n".join(log_lines("A2"))
m = re.search(r"resumed at step (\d+) from (\w+)", a2)
S["A2"] = {"status": status("A2"), "resumed": m.group(0) if m else None, "done": "done:" in a2}
lines.append(f"A2 resume from DCP checkpoint onto GPU     : {S['A2']['status']}; {S['A2']['resumed'] or 'no resume line'}"
             + (f"; {last_error('A2')}" if parts.get("A2", {}).get("status") == "FAIL" else ""))

k = "\n".join(log_lines("K"))
S["K"] = {"status": status("K"), "done": "done:" in k, "fell_back": "fork server" in k}
lines.append(f"K  2 ranks forked by the fork server        : {S['K']['status']}; finished={S['K']['done']}, "
             f"fell back to fresh processes={S['K']['fell_back']}" + (f"; {last_error('K')}" if S["K"]["status"] == "FAIL" else ""))

e = load("E_prewarm.json")
S["E"] = e
if e:
    lines.append(f"E  spare/parked imports + prewarm()        : {status('E')}; CUDA initialised={e.get('cuda_initialized_after_prewarm')}, "
                 f"on GPU after prewarm={e.get('on_gpu_after_prewarm')}, after set_device={e.get('on_gpu_after_set_device')}, "
                 f"after first tensor={e.get('on_gpu_after_first_tensor')}; libcuda mapped: at start "
                 f"{e.get('libcuda_mapped_at_start')}, after import torch {e.get('libcuda_mapped_after_import_torch')}, "
                 f"after prewarm {e.get('libcuda_mapped_after_prewarm')}; driver initialised (fork server's test) "
                 f"{e.get('driver_initialised_after_prewarm')}")
else:
    lines.append(f"E  spare/parked imports + prewarm()        : {status('E')} {last_error('E')}")

b = load("B1_cycles.json")
S["B1"] = b
if b:
    g, k = b.get("graceful") or {}, b.get("broken") or {}
    lines.append(f"B1 NCCL w1 rounds, destroy (x{g.get('rounds', 0)})       : {status('B1')}; init first {g.get('init_first_s')}s median "
                 f"{g.get('init_median_s')}s, teardown {g.get('teardown_median_s')}s, ok={g.get('all_ok')}, DDP freed={g.get('ddp_always_freed')}, "
                 f"growth {g.get('growth')}")
    lines.append(f"B1 NCCL w1 rounds, abort+re-form (x{k.get('rounds', 0)})  : init median {k.get('init_median_s')}s, teardown "
                 f"{k.get('teardown_median_s')}s, ok={k.get('all_ok')}, growth {k.get('growth')}"
                 + (f"; ERROR {b['error']}" if b.get("error") else ""))
    h = b.get("hazard") or {}
    lines.append(f"B1 host/device ordering                    : optimizer.step() returned after {h.get('host_returned_from_optimizer_step_s')}s, "
                 f"device done after {h.get('device_finished_s')}s {h.get('error', '')}")
else:
    lines.append(f"B1 NCCL w1 rounds                          : {status('B1')} {last_error('B1')}")
for tag in ("B1a_aeh1", "B1a_aeh0"):
    r = load(f"{tag}.json")
    S[tag] = r
    if r:
        lines.append(f"{tag} abort while blocked (AEH={r.get('TORCH_NCCL_ASYNC_ERROR_HANDLING')})     : {status(tag)}; abort {r.get('abort')} "
                     f"in {r.get('abort_call_s')}s, main sync {r.get('main_thread_sync')} after {r.get('main_thread_blocked_s')}s; "
                     f"old group: {r.get('old_group_after_abort')}; re-form: {r.get('reform_after_abort')} ({r.get('reform_s')}s)")
    else:
        lines.append(f"{tag} abort while blocked                   : {status(tag)} {last_error(tag)}")

s = load("B2_snapshots.json")
S["B2"] = s
if s:
    r0 = s["ranks"][0]
    lines.append(f"B2 snapshots, {r0.get('params_m')}M params, {r0.get('state_gb')} GB/rank : {status('B2')}; copies exact={s['ok']}; step ms "
                 f"{s['step_ms']} (x{s['overhead_every1']} every step, x{s['overhead_every5']} every 5th); chain {r0.get('chain_s')}s = "
                 f"{r0.get('chain_gb_s')} GB/s; D2H pageable {r0.get('d2h_pageable_gb_s')} / pinned {r0.get('d2h_pinned_gb_s')} GB/s; "
                 f"host copies {r0.get('held_host_gb')} GB, pinned allocated {r0.get('pinned_allocated_gb')} GB")
else:
    lines.append(f"B2 snapshots                               : {status('B2')} {last_error('B2')}")

o = load("O_own_copy/own_copy_cuda_quick.json")
S["O"] = o["summary"] if o else None
if o:
    os_ = o["summary"]
    lines.append(f"O  copy one step back, {os_['state_mb']} MB, ms/step : {status('O')}; " + ", ".join(f"{k} {v}" for k, v in os_["step_ms"].items())
                 + f"; at_seal/none {os_['at_seal_over_none']['ratio']}, overlapped/none {os_['overlapped_over_none']['ratio']} "
                 f"(CI {os_['overlapped_over_none']['ci_low']}-{os_['overlapped_over_none']['ci_high']}); copies checked {os_['copies_checked']}")
else:
    lines.append(f"O  copy one step back                      : {status('O')} {last_error('O')}")

TPS_1B = 8 * 1024
c1 = load("C1_bare_1b.json")
tp = {"bare (no hyperpodrun API)": c1.get("tokens_per_s") if c1 else None,
      "torchrun (API inert)": tokens_per_s("C4_torchrun_1b_ddp.metrics.jsonl", TPS_1B),
      "hyperpodrun (API live)": tokens_per_s("C3_hpr_1b_ddp.metrics.jsonl", TPS_1B),
      "hyperpodrun --fsdp": tokens_per_s("D_hpr_1b_fsdp.metrics.jsonl", TPS_1B),
      "hyperpodrun, no commit check": tokens_per_s("C5_hpr_1b_ddp_nocommit.metrics.jsonl", TPS_1B)}
S["C"] = {"tokens_per_s": tp, "status": {n: status(n) for n in ("C3", "C5", "C1", "C4", "D")}}
ratio = lambda x, y: round(x / y, 3) if x and y else None  # noqa: E731
S["C"]["ratios"] = {"hyperpodrun/torchrun": ratio(tp["hyperpodrun (API live)"], tp["torchrun (API inert)"]),
                    "hyperpodrun/bare": ratio(tp["hyperpodrun (API live)"], tp["bare (no hyperpodrun API)"]),
                    "torchrun/bare": ratio(tp["torchrun (API inert)"], tp["bare (no hyperpodrun API)"]),
                    "fsdp/ddp (hyperpodrun)": ratio(tp["hyperpodrun --fsdp"], tp["hyperpodrun (API live)"]),
                    "commit check on/off": ratio(tp["hyperpodrun (API live)"], tp["hyperpodrun, no commit check"])}
lines.append("C  llama3.2-1b w1, 8x1024 tok/step, tok/s  : " + ", ".join(f"{k} {v}" for k, v in tp.items()))
lines.append("C  ratios                                   : " + ", ".join(f"{k} {v}" for k, v in S["C"]["ratios"].items())
             + "; " + ", ".join(f"{k} {v}" for k, v in S["C"]["status"].items()))
for n in ("C3", "C1", "C4", "D"):
    if parts.get(n, {}).get("status") in ("FAIL", "TIMEOUT"):
        lines.append(f"   {n}: {last_error(n)}")

h_log = "\n".join(log_lines("H"))
S["H"] = {"status": status("H"), "done": "done:" in h_log, "mesh_line": next((ln for ln in log_lines("H") if "HSDP" in ln), ""),
          "error": last_error("H") if "done:" not in h_log else ""}
lines.append(f"H  example tiny --hsdp, cuda+NCCL w1      : {S['H']['status']}; finished={S['H']['done']} {S['H']['error']}")
h_tp = {"hyperpodrun --hsdp": tokens_per_s("H3_hpr_1b_hsdp.metrics.jsonl", TPS_1B),
        "hyperpodrun --hsdp, no commit check": tokens_per_s("H5_hpr_1b_hsdp_nocommit.metrics.jsonl", TPS_1B),
        "torchrun --hsdp": tokens_per_s("H4_torchrun_1b_hsdp.metrics.jsonl", TPS_1B)}
S["H"]["tokens_per_s_1b"] = h_tp
S["H"]["hyperpodrun/torchrun"] = ratio(h_tp["hyperpodrun --hsdp"], h_tp["torchrun --hsdp"])
S["H"]["commit check on/off"] = ratio(h_tp["hyperpodrun --hsdp"], h_tp["hyperpodrun --hsdp, no commit check"])
lines.append("H  llama3.2-1b --hsdp w1, tok/s           : " + ", ".join(f"{k} {v}" for k, v in h_tp.items())
             + f"; hyperpodrun/torchrun {S['H']['hyperpodrun/torchrun']}, commit check on/off {S['H']['commit check on/off']}"
             + f"; H3 {status('H3')}, H5 {status('H5')}, H4 {status('H4')}")
for n in ("H", "H3", "H5", "H4"):
    if parts.get(n, {}).get("status") in ("FAIL", "TIMEOUT"):
        lines.append(f"   {n}: {last_error(n)}")

f_log = "\n".join(log_lines("F"))
S["F"] = {"status": status("F"), "done": "done:" in f_log, "error": last_error("F") if "done:" not in f_log else ""}
lines.append(f"F  --deterministic-reduce on CUDA          : {S['F']['status']}; finished={S['F']['done']} {S['F']['error']}")
pp = load("P_pinned.json")
S["P"] = pp
lines.append(f"P  exact pinned snapshot memory             : {status('P')}; " + (
    f"{pp.get('bytes')} bytes pinned, caching allocator +{pp.get('host_allocator_bytes_added')} bytes, D2H "
    f"{pp.get('d2h_gb_s')} GB/s, bytes equal {pp.get('bytes_equal')}, re-registered {pp.get('registered_again')}"
    if pp else last_error("P")))
g = load("G_kill_release.json")
S["G"] = g
lines.append(f"G  GPU memory after SIGKILL of a busy rank : {status('G')}; " + (
    f"{g.get('gb')} GB reallocatable {g.get('same_size_allocatable_after_s')}s after the kill (reaped {g.get('reaped_s')}s)" if g else last_error("G")))
text = "\n".join(lines)
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(S, f, indent=1, default=str)
with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write(text + "\n")
print(text)
EOF

cat > "$WORK/hpr.sh" <<'EOF'
#!/usr/bin/env bash
# hpr.sh NAME ARGS... : hyperpodrun with its elastic agent live (--nnodes 1:1, c10d store), one rank
name=$1; shift
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec "$PY" -m hyperpodrun --nnodes 1:1 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" \
  --rdzv-id "gpucheck-$name" --log-dir "$WORK/logs-$name" "$@"
EOF

cat > "$WORK/part_a.sh" <<'EOF'
#!/usr/bin/env bash
# Part A: the example (tiny) on cuda + NCCL under hyperpodrun, with a poller watching who holds the GPU.
rm -f "$WORK/poll.stop"
"$PY" "$WORK/py/poll.py" "$WORK" "$OUT/A_gpu_procs.json" "$WORK/poll.stop" &
poller=$!
bash "$WORK/hpr.sh" A --event-log "$OUT/A_events.jsonl" "$TRAIN" --model tiny --device cuda --steps 250 \
  --min-step-time 0.08 --log-every 10 --ckpt-every 100 --async-checkpoint --num-workers 2 \
  --metrics "$OUT/A_metrics.jsonl" --run-dir "$WORK/run-A" --data-cache "$WORK/data"
rc=$?
touch "$WORK/poll.stop"
wait "$poller"
exit $rc
EOF

# ----------------------------------------------------------------------------------------------- the parts

# 0. install what is missing (counts against the budget), then versions
if ! "$PY" -c 'import sys, torch, elastic_events, hyperpodrun, torchdata, psutil; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if [ -n "${WHEELS:-}" ]; then  # a machine without a registry: the project's missing packages as wheels
    run_part install 120 30 bash -c "\"$PY\" -m pip install -q --no-index --no-deps --target \"$WORK/site\" \"$WHEELS\"/*.whl"
    export PYTHONPATH="$WORK/site:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
  elif [ "${INSTALL:-1}" = 1 ]; then
    run_part install 300 60 bash -c "\"$PY\" -m pip install -q 'torch==2.13.0' && \"$PY\" -m pip install -q -e ."
  fi
fi
run_part info 60 10 "$PY" "$WORK/py/info.py" "$OUT/info.json"
if [ "$(awk -F'\t' '$1 == "info" { print $2 }' "$PARTS")" != PASS ]; then
  echo "no CUDA torch or the project is not importable: see $OUT/info.log" >&2
  "$PY" "$WORK/py/summarize.py" "$OUT" 2>/dev/null
  exit 3
fi

COMMON_1B=(--model llama3.2-1b --device cuda --seq-len 1024 --global-batch 8 --micro-batch 4 --steps "${STEPS_1B:-30}" --log-every 1
           --lr 1e-4 --warmup-steps 2 --num-workers 2 --data-cache "$WORK/data")

run_part A   150 60 bash "$WORK/part_a.sh"
run_part A2   75 30 bash "$WORK/hpr.sh" A2 "$TRAIN" --model tiny --device cuda --steps 270 --log-every 10 --num-workers 2 \
  --metrics "$OUT/A2_metrics.jsonl" --run-dir "$WORK/run-A" --data-cache "$WORK/data"
run_part E    45 15 "$PY" "$WORK/py/prewarm_check.py" "$OUT/E_prewarm.json"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')  # NCCL takes one rank per GPU
run_part K    60 25 bash "$WORK/hpr.sh" K --nproc-per-node "$(( GPUS > 2 ? 2 : GPUS > 0 ? GPUS : 1 ))" --start-method forkserver "$TRAIN" --model tiny --device cuda \
  --steps 30 --log-every 10 --num-workers 0 --metrics "$OUT/K_metrics.jsonl" --run-dir "$WORK/run-K" --data-cache "$WORK/data"
run_part H    75 25 bash "$WORK/hpr.sh" H "$TRAIN" --model tiny --device cuda --hsdp --steps 40 --log-every 10 \
  --ckpt-every 20 --num-workers 0 --metrics "$OUT/H_metrics.jsonl" --run-dir "$WORK/run-H" --data-cache "$WORK/data"
run_part B1  120 45 env TORCH_NCCL_ASYNC_ERROR_HANDLING=2 "$PY" "$WORK/py/nccl_cycle.py" cycles --graceful "${B1_GRACEFUL:-20}" \
  --broken "${B1_BROKEN:-10}" --out "$OUT/B1_cycles.json"
run_part P    45 15 "$PY" "$WORK/py/pinned_check.py" "$OUT/P_pinned.json"
run_part O    90 30 "$PY" "$REPO/benchmarks/own_copy.py" --quick --out "$OUT/O_own_copy"
run_part B1m  60 20 env TORCH_NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ENABLE_MONITORING=0 "$PY" "$WORK/py/nccl_cycle.py" cycles --graceful 6 --broken 4 --out "$OUT/B1m_cycles.json"
run_part B1a_aeh1 50 20 env TORCH_NCCL_ASYNC_ERROR_HANDLING=1 "$PY" "$WORK/py/nccl_cycle.py" abort_blocked --out "$OUT/B1a_aeh1.json"
run_part B1a_aeh0 50 20 env TORCH_NCCL_ASYNC_ERROR_HANDLING=0 "$PY" "$WORK/py/nccl_cycle.py" abort_blocked --out "$OUT/B1a_aeh0.json"
run_part B2  150 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "$WORK/py/snap_check.py" --out "$OUT/B2_snapshots.json"
run_part C3  120 45 bash "$WORK/hpr.sh" C3 "$TRAIN" "${COMMON_1B[@]}" --metrics "$OUT/C3_hpr_1b_ddp.metrics.jsonl" --run-dir "$WORK/run-C3"
run_part C5  120 45 bash "$WORK/hpr.sh" C5 "$TRAIN" "${COMMON_1B[@]}" --no-commit-check \
  --metrics "$OUT/C5_hpr_1b_ddp_nocommit.metrics.jsonl" --run-dir "$WORK/run-C5"
run_part C1   90 35 "$PY" "$WORK/py/bare_loop.py" --model llama3.2-1b --seq-len 1024 --global-batch 8 --micro-batch 4 --steps 30 --out "$OUT/C1_bare_1b.json"
run_part C4  120 45 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 "$TRAIN" "${COMMON_1B[@]}" \
  --metrics "$OUT/C4_torchrun_1b_ddp.metrics.jsonl" --run-dir "$WORK/run-C4"
run_part D   120 45 bash "$WORK/hpr.sh" D "$TRAIN" "${COMMON_1B[@]}" --fsdp --metrics "$OUT/D_hpr_1b_fsdp.metrics.jsonl" --run-dir "$WORK/run-D"
run_part H3  120 45 bash "$WORK/hpr.sh" H3 "$TRAIN" "${COMMON_1B[@]}" --hsdp --metrics "$OUT/H3_hpr_1b_hsdp.metrics.jsonl" --run-dir "$WORK/run-H3"
run_part H5  120 45 bash "$WORK/hpr.sh" H5 "$TRAIN" "${COMMON_1B[@]}" --hsdp --no-commit-check \
  --metrics "$OUT/H5_hpr_1b_hsdp_nocommit.metrics.jsonl" --run-dir "$WORK/run-H5"
run_part H4  120 45 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 "$TRAIN" "${COMMON_1B[@]}" --hsdp \
  --metrics "$OUT/H4_torchrun_1b_hsdp.metrics.jsonl" --run-dir "$WORK/run-H4"
run_part F    60 20 "$PY" "$TRAIN" --model tiny --device cuda --deterministic-reduce --steps 4 --log-every 1 --num-workers 0 \
  --run-dir "$WORK/run-F" --data-cache "$WORK/data"
run_part G    45 20 "$PY" "$WORK/py/kill_release.py" "$OUT/G_kill_release.json"

echo
echo "== summary ($(( $(date +%s) - START ))s; details in $OUT) =="
"$PY" "$WORK/py/summarize.py" "$OUT"
