"""A retry budget shared by the fleet (policy/retry_budget.py `set_peers`): the other
daemons' requests and retries in flight count against the same limit."""

from __future__ import annotations

from turnkeeper.policy.retry_budget import RetryBudget


def test_peers_retries_use_up_the_budget_and_their_requests_raise_it() -> None:
    b = RetryBudget(ratio=0.5, min_concurrency=1)
    for _ in range(4):
        b.begin_request()
    assert b.limit == 2.0
    b.set_peers(requests=0, retries=2)  # the fleet already retries twice
    assert not b.try_begin_retry()
    b.set_peers(requests=4, retries=2)  # with their requests: a limit of 4
    assert b.limit == 4.0
    assert b.try_begin_retry() and b.try_begin_retry()
    assert not b.try_begin_retry()
    assert b.retries_in_flight == 2  # its own: the peers' are theirs to end


def test_alone_the_budget_is_what_it_was() -> None:
    b = RetryBudget(ratio=0.2, min_concurrency=3)
    b.set_peers(requests=-5, retries=-1)  # nonsense from a peer counts as nothing
    assert b.limit == 3.0
    assert all(b.try_begin_retry() for _ in range(3))
    assert not b.try_begin_retry()
