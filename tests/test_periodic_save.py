"""Periodic saving's vote (pretrain/periodic_save.py): every N steps on every rank, and by rank 0's clock
since the last save ended; the loop's agreement on the vote is tested with real ranks in
tests/test_reliability_faults.py."""

from __future__ import annotations

from pretrain import periodic_save
from pretrain.periodic_save import PeriodicSave


def test_every_steps_votes_on_every_rank():
    votes = [[PeriodicSave(5, 0, rank).save_due(step) for step in range(1, 11)] for rank in (0, 1)]
    assert votes[0] == votes[1] == [step % 5 == 0 for step in range(1, 11)]


def test_the_clock_votes_on_rank_0_only_and_restarts_at_each_save(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(periodic_save.time, "monotonic", lambda: now[0])
    rank0, rank1 = PeriodicSave(0, 1.0, 0), PeriodicSave(0, 1.0, 1)
    now[0] = 159.0
    assert not rank0.save_due(1)
    now[0] = 160.0
    assert rank0.save_due(2) and not rank1.save_due(2)
    rank0.on_save(2)  # the save ends at 160 s: the next one is due a minute later, not at every step from now
    now[0] = 200.0
    assert not rank0.save_due(3)
    now[0] = 220.0
    assert rank0.save_due(4)
    assert not PeriodicSave(0, 0, 0).save_due(5)  # every_minutes=0: no clock
