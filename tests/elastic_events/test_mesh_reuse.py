"""``elastic_events.rounds.mesh.build_mesh`` across rounds: a round whose mesh has an earlier round's shape gets
that earlier mesh object back, bound to the new round's subgroups, so DTensor's sharding propagations cached
for it are reused and resolve to live groups (2 real gloo ranks, their group torn down and formed again as
rounds are: ``workers/mesh_rounds.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.ports import free_port

WORKER = Path(__file__).resolve().parent / "workers" / "mesh_rounds.py"


def test_a_round_of_an_earlier_shape_reuses_its_mesh_and_dtensors_cached_shardings(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port), str(tmp_path / f"rank{rank}.json")])
        for rank in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    rounds = [json.loads((tmp_path / f"rank{process}.json").read_text()) for process in (0, 1)]
    for rank in (0, 1):
        first, other, again, swapped = rounds[rank]
        assert first["computed"] > 10 and other["computed"] > 10  # a new shape computes every op's sharding
        assert other["same_object_as"] == [] and first["same_object_as"] == []
        assert again["same_object_as"] == [0]  # the 1 x 2 mesh of round 0: the object its cached specs name
        assert again["computed"] == 0, f"rank {rank}: {again['computed']} shardings computed again for a known shape"
        assert again["group_names"] != first["group_names"]  # bound to round 2's subgroups ...
        assert again["resolved"] == again["group_names"]  # ... which its get_group() resolves
        assert again["weights"] == first["weights"]  # the same training on the reused mesh, to the bit
        # the processes swap ranks in a mesh of the same shape: the same object, at this round's coordinates
        assert swapped["same_object_as"] == [0, 2] and swapped["computed"] == 0
        assert swapped["rank"] == 1 - rank and swapped["coordinate"] == [0, 1 - rank]
        assert swapped["weights"] == first["weights"]
        # each holds the shard of its new rank: the one the other process held as that rank in round 0
        assert swapped["local_shards"] == rounds[1 - rank][0]["local_shards"]
