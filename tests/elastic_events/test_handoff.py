"""A blocked rank's state in node-local memory, for its replacement (elastic_events.rounds.handoff)."""

from __future__ import annotations

import pytest
import torch

from elastic_events.contract import CONTROL_FILE_ENV
from elastic_events.rounds.handoff import discard_handoff, find_handoff, load_handoff, write_handoff


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
