"""A short crash torture (bench/torture.py): 20 kills under load from 6 worker processes,
SIGKILLs at random moments and at named crash points, with the other faults this machine
can inflict (a socket intruder, wall-clock steps, a full disk), invariants checked after
each."""

from __future__ import annotations

import random

from torture import available_faults, torture


def test_twenty_kills_lose_nothing_and_run_nothing_twice(short_tmp):
    seed = random.randrange(2**32)
    tally = torture(
        20, 6, seed=seed, crash_points=True, workdir=short_tmp, faults=available_faults()
    )
    summary = f"seed={seed} " + tally.line(0)
    assert tally.failures == [], summary
    startup_crashes = (
        tally.crash_points["reconcile.before_commit"] + tally.crash_points["migrate.before_commit"]
    )
    assert tally.kills >= 20 and tally.checks >= tally.kills - startup_crashes, summary
    assert tally.acknowledged > 0 and tally.lost == 0 and tally.double_effects == 0, summary
