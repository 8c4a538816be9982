"""A short two-box torture (bench/torture_boxes.py --quick): two real daemons on one
private durable PostgreSQL cluster, worker processes on both boxes (idempotent steps,
leases, fenced effects), and six faults in a random order: kill -9 of either daemon
(once at a crash point after a commit, before any answer), SIGKILL of the whole server,
and, with tests/tcp_proxy.py, one box cut off past the presence TTL until the other
declares it dead. Then every invariant, checked against the workers' journals, the
database and both boxes: nothing acknowledged lost, nothing executed twice, fencing
tokens increasing per resource, no grant over a holder that still held its lease (but
for a holder fenced out by its box's death), no superseded token accepted."""

from __future__ import annotations

import random
import time

import pytest
from torture_boxes import QUICK, available_faults, report, torture

from pg_cluster import postgres_available, require_postgres


@pytest.mark.slow
def test_two_boxes_under_faults_lose_nothing_run_nothing_twice_and_fence_every_grant(short_tmp):
    require_postgres(postgres_available())
    seed = random.randrange(2**32)
    faults = available_faults()
    started = time.monotonic()
    tally = torture(QUICK, seed=seed, workdir=short_tmp, faults=faults)
    summary = report(tally, seed, QUICK, faults, time.monotonic() - started)
    assert tally.failures == [], summary
    kinds = tally.fault_counts()
    assert tally.kills == QUICK.kills and set(kinds) == set(faults), summary
    assert all(kinds[kind] >= QUICK.kills // len(faults) for kind in faults), summary
    # Every part of the load ran and was checked.
    assert tally.acknowledged > 0 and tally.grants > 0 and tally.effects_committed > 0, summary
    assert tally.lost == 0 and tally.double_effects == 0 and tally.effects_lost == 0, summary
    assert tally.effects_double == 0 and tally.token_regressions == 0, summary
    assert tally.overlaps == 0 and tally.stale_accepted == 0, summary
    if "partition" in faults:  # each cut-off box was declared dead by the other
        assert tally.box_deaths >= kinds["partition"], summary
