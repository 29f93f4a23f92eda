"""One rank of the full-state checks: the gather and the three scatter cases in one process group.

argv: RANK WORLD PORT BUCKET_BYTES. Prints one JSON line: ``{"gather": ..., "rows": ..., "columns": ...,
"reordered": ...}``, each that check's result on this rank (``full_gather_check``, ``full_scatter_check``).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import full_gather_check
import full_scatter_check
import torch.distributed as dist

SCATTER_CASES = ("rows", "columns", "reordered")


def main() -> int:
    rank, world, port, bucket = (int(a) for a in sys.argv[1:5])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    result = {"gather": full_gather_check.check(rank, world, bucket)}
    for case in SCATTER_CASES:
        result[case] = full_scatter_check.check(rank, world, bucket, case)
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
