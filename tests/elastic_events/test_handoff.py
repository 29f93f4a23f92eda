"""A blocked rank's state in node-local memory, for its replacement (elastic_events.rounds.handoff)."""

from __future__ import annotations

import pytest
import torch

from elastic_events.contract import CONTROL_FILE_ENV
from elastic_events.rounds.handoff import (
    HandedPieces,
    HandoffKind,
    discard_handoff,
    find_handoff,
    load_handoff,
    write_handoff,
)
from elastic_events.rounds.replica_plan import Holding
from elastic_events.rounds.snapshot import Piece, capture
from elastic_events.rounds.snapshot_restore import SnapshotReport, local_tensors


def test_a_hand_off_is_found_only_for_the_repair_it_was_written_for(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CONTROL_FILE_ENV, str(tmp_path / "control.bin"))
    state = {
        "model": {"weight": torch.arange(6.0).view(2, 3)},
        "optimizer": None,
        "small": {"step": 7, "sampler": {"pos": 56}},
    }
    write_handoff(1, round=4, step=7, control_step=9, state=state)
    assert find_handoff(0, round=4) is None  # another local rank's slot
    assert find_handoff(1, round=5) is None  # a later repair never takes an old hand-off
    found = find_handoff(1, round=4)
    assert (found.step, found.control_step) == (7, 9)
    loaded = load_handoff(found)
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"]) and loaded["small"] == state["small"]
    discard_handoff(1)
    assert find_handoff(1, round=4) is None and list(tmp_path.iterdir()) == []


def test_a_half_written_hand_off_is_never_found(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CONTROL_FILE_ENV, str(tmp_path / "control.bin"))
    torch.save({"model": {}}, tmp_path / "handoff-0.pt")  # the state, without the marker written last
    assert find_handoff(0, round=1) is None


def test_outside_a_launcher_there_is_nowhere_to_hand_off(monkeypatch) -> None:
    monkeypatch.delenv(CONTROL_FILE_ENV, raising=False)
    assert write_handoff(0, round=1, step=1, control_step=1, state={}) is None
    assert find_handoff(0, round=1) is None


def test_a_hand_off_that_cannot_be_read_raises_on_load(tmp_path, monkeypatch) -> None:
    """The joining rank reads it before the round's plan and offers none when this raises."""
    monkeypatch.setenv(CONTROL_FILE_ENV, str(tmp_path / "control.bin"))
    write_handoff(0, round=2, step=3, control_step=3, state={"model": {}})
    (tmp_path / "handoff-0.pt").write_bytes(b"not a torch file")
    found = find_handoff(0, round=2)
    assert found is not None
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own unpickling / zip errors
        load_handoff(found)


def _pieces(owner_steps: list[tuple[int, int]]) -> list[Piece]:
    """A model and its optimizer's state after a step, as snapshot pieces of ``owner_steps`` (values per piece)."""
    pieces = []
    for owner, step in owner_steps:
        torch.manual_seed(owner * 100 + step)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        c = capture(model, optimizer)
        pieces.append(
            Piece(
                owner=owner,
                round=6,
                world_size=2,
                step=step,
                layout=c.layout,
                small={"step": step, "sampler": {"pos": 8 * step}},
                param_groups=c.param_groups(optimizer),
                tensors=c.tensors,
            )
        )
    return pieces


@pytest.mark.parametrize("holding", [None, Holding(shard_size=2, shard=1, step=51, previous=50)])
def test_a_sharded_ranks_pieces_come_back_as_written_and_report_what_it_held(tmp_path, monkeypatch, holding) -> None:
    """Its live piece (rank 0 at step 51) and the copies it held (rank 1's at 49, its own at 49): the replacement
    reads every tensor byte for byte and reports the copies as the rank would have."""
    monkeypatch.setenv(CONTROL_FILE_ENV, str(tmp_path / "control.bin"))
    written = _pieces([(0, 51), (1, 49), (0, 49)])
    handed = HandedPieces(round=6, world_size=2, rank=0, live_step=51, holding=holding, pieces=tuple(written))
    write_handoff(0, round=7, step=51, control_step=53, state=handed.to_state(), kind=HandoffKind.PIECES)
    found = find_handoff(0, round=7)
    assert found is not None and found.kind is HandoffKind.PIECES and (found.step, found.control_step) == (51, 53)
    back = HandedPieces.from_state(load_handoff(found))
    assert (back.round, back.world_size, back.rank, back.live_step, back.holding) == (6, 2, 0, 51, holding)
    assert back.snapshot_report() == SnapshotReport(
        round=6, world_size=2, rank=0, live_step=51, replicas=((1, 49), (0, 49))
    )
    for piece in written:
        got = back.piece(piece.owner, piece.step)
        assert got is not None and got.small == piece.small and got.param_groups == piece.param_groups
        assert got.layout == piece.layout
        for a, b in zip(local_tensors(got), piece.tensors, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert back.at(51) is back.piece(0, 51) and back.at(50) is None and back.piece(1, 51) is None
