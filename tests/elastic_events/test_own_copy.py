"""HSDP's copy one step back (elastic_events.rounds.own_copy): what it holds after the live state moves on,
and while the copy of the next step is under way."""

from __future__ import annotations

import torch

from elastic_events.rounds.own_copy import OwnCopy
from elastic_events.rounds.snapshot import Piece, capture


def trained_once() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


def piece_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, small: dict) -> Piece:
    c = capture(model, opt)
    return Piece(
        owner=1,
        round=3,
        world_size=4,
        step=step,
        layout=c.layout,
        small=small,
        param_groups=c.param_groups(opt),
        tensors=c.tensors,
    )


def values(piece: Piece) -> list[torch.Tensor]:
    """The tensors a copy holds, as the live tensors' dtypes and shapes."""
    return [t.view(e.dtype).view(e.local_shape) for t, e in zip(piece.tensors, piece.layout.entries, strict=True)]


def start(own: OwnCopy, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    c = capture(model, opt)
    own.start(c.layout, c.tensors)


def test_the_copy_keeps_the_state_and_small_state_of_its_step_while_the_live_ones_move_on() -> None:
    model, opt = trained_once()
    sampler = {"position": 40}
    before = [t.clone() for t in capture(model, opt).tensors]
    own = OwnCopy()
    assert own.piece() is None and own.step is None
    start(own, model, opt)  # the post-step hook of step 5
    own.seal(piece_of(model, opt, step=5, small={"step": 5, "sampler": sampler}))  # the pre-step hook of 6

    opt.step()  # the step the copy was sealed before: the live weights and momentum change
    sampler["position"] = 48
    kept = own.piece()
    assert kept is not None and (kept.step, kept.owner) == (5, 1) and own.step == 5
    assert kept.small == {"step": 5, "sampler": {"position": 40}}  # a copy, not the live sampler state
    after = capture(model, opt).tensors
    for live, old, copied, entry in zip(after, before, values(kept), kept.layout.entries, strict=True):
        assert not torch.equal(live, old), entry.key  # each tensor of the state moved on
        assert torch.equal(copied, old), entry.key
    assert (own.taken, own.overlapped) == (1, 1)


def test_the_sealed_copy_stays_whole_while_the_next_one_is_copied_until_it_is_sealed() -> None:
    """A rank of shard 0 that applied step s while shard 1 did not blocks in step s + 1 between the copy's
    start and its seal: it must still hold s - 1 there. With one buffer the start would overwrite it."""
    model, opt = trained_once()
    own = OwnCopy()
    own.take(piece_of(model, opt, step=4, small={"step": 4}))
    at_4 = [t.clone() for t in capture(model, opt).tensors]
    train(model, opt)  # step 5 applied
    at_5 = [t.clone() for t in capture(model, opt).tensors]
    start(own, model, opt)  # its post-step hook: the copy of 5 starts, not sealed
    kept = own.piece()
    assert kept is not None and kept.step == 4
    for copied, old, entry in zip(values(kept), at_4, kept.layout.entries, strict=True):
        assert torch.equal(copied, old), entry.key
    assert any(not torch.equal(a, b) for a, b in zip(at_4, at_5, strict=True))

    own.seal(piece_of(model, opt, step=5, small={"step": 5}))  # the pre-step hook of 6
    train(model, opt)  # step 6 applied
    start(own, model, opt)  # and the copy of 6 starts, into the buffer that held 4
    kept = own.piece()
    assert kept is not None and kept.step == 5
    for copied, old, entry in zip(values(kept), at_5, kept.layout.entries, strict=True):
        assert torch.equal(copied, old), entry.key
    assert own.nbytes == 2 * kept.layout.nbytes  # two buffers, no more, however many steps
    assert (own.taken, own.overlapped) == (2, 1)


def test_a_seal_without_a_started_copy_of_its_layout_copies_at_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    own = OwnCopy()
    own.seal(piece_of(model, opt, step=0, small={"step": 0}))  # a round's first step: nothing started
    weights_only = own.piece()
    assert weights_only is not None and own.overlapped == 0
    start(own, model, opt)  # started before the optimizer state appeared: weights only
    train(model, opt)  # the first step: momentum appears
    own.seal(piece_of(model, opt, step=1, small={"step": 1}))  # another layout: copied at the seal
    kept = own.piece()
    assert kept is not None and kept.step == 1 and own.overlapped == 0
    assert kept.layout.nbytes > weights_only.layout.nbytes
    assert [e.key[0] for e in kept.layout.entries].count("optim") == 2  # momentum of weight and bias
    for copied, live, entry in zip(values(kept), capture(model, opt).tensors, kept.layout.entries, strict=True):
        assert torch.equal(copied, live), entry.key


def test_snapshots_start_the_copy_at_the_steps_end_once_and_seal_it_before_the_next_optimizer_step() -> None:
    """What the script changes after ``optimizer.step()`` (here it halves the weight) is in the copy: it starts
    at ``elastic_event_detected()`` (:meth:`Snapshots.take`), once however often that is called."""
    from types import SimpleNamespace

    from elastic_events.rounds.config import ElasticConfig
    from elastic_events.rounds.snapshots import Snapshots

    model, opt = trained_once()
    state = SimpleNamespace(step=1, optimizer=opt, optimizer_steps=[1, 1], built_model=lambda: model)
    snapshots = Snapshots(SimpleNamespace(config=ElasticConfig()), state)  # type: ignore[arg-type]
    own = snapshots.own = OwnCopy()
    snapshots.replicas, snapshots.captured = True, capture(model, opt)
    snapshots.piece = lambda step: piece_of(model, opt, step=step, small={"step": step})  # type: ignore[method-assign]
    with torch.no_grad():
        model.weight.mul_(0.5)  # the script, after the optimizer step
    at_1 = [t.clone() for t in capture(model, opt).tensors]
    snapshots.take()
    snapshots.take()  # elastic_event_detected() twice in one step: one copy
    assert own.started == 1
    snapshots.wait()  # the pre-step hook of step 2
    train(model, opt)
    kept = own.piece()
    assert kept is not None and kept.step == 1 and (own.taken, own.overlapped) == (1, 1)
    for copied, old, entry in zip(values(kept), at_1, kept.layout.entries, strict=True):
        assert torch.equal(copied, old), entry.key
    state.optimizer_steps, state.step = [2, 2], 2
    snapshots.take()  # the next step's end: a new copy
    assert own.started == 2
