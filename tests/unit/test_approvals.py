"""Which tool calls wait for a person, and what the end of the wait does (plain numbers
for the clock)."""

from __future__ import annotations

import pytest

from turnkeeper.policy.approvals import (
    ApprovalWait,
    TimeoutDeny,
    denial_text,
    needs_approval,
)
from turnkeeper.policy.outcome import Stop, StopCode, status_of


@pytest.mark.parametrize(("idempotent", "destructive"),
                         [(True, False), (False, False), (True, True), (False, True)])
def test_never_lets_every_call_run(idempotent: bool, destructive: bool) -> None:
    assert not needs_approval("never", idempotent=idempotent, destructive=destructive)


@pytest.mark.parametrize(("idempotent", "destructive"),
                         [(True, False), (False, False), (True, True), (False, True)])
def test_always_holds_every_call(idempotent: bool, destructive: bool) -> None:
    assert needs_approval("always", idempotent=idempotent, destructive=destructive)


def test_effects_holds_non_idempotent_and_destructive_calls_only() -> None:
    assert needs_approval("effects", idempotent=False, destructive=False)
    assert needs_approval("effects", idempotent=True, destructive=True)
    assert needs_approval("effects", idempotent=False, destructive=True)
    assert not needs_approval("effects", idempotent=True, destructive=False)


def test_wait_keeps_waiting_before_the_deadline() -> None:
    wait = ApprovalWait(timeout_s=60.0, on_timeout="stop")
    assert wait.at([100.0], now=100.0) is None
    assert wait.at([100.0], now=159.999) is None
    assert wait.deadline([100.0, 90.0]) == 150.0


def test_stop_at_the_deadline_names_approval_seconds() -> None:
    wait = ApprovalWait(timeout_s=60.0, on_timeout="stop")
    stop = wait.at([100.0, 130.0], now=160.0)
    assert isinstance(stop, Stop)
    assert stop.code is StopCode.APPROVAL_TIMEOUT
    assert stop.counter == "approval_seconds"
    assert (stop.value, stop.limit) == (60.0, 60.0)
    assert status_of(stop.code).value == "partial"


def test_deadline_counts_from_the_oldest_request() -> None:
    wait = ApprovalWait(timeout_s=60.0, on_timeout="stop")
    assert wait.at([130.0, 100.0], now=159.0) is None
    assert isinstance(wait.at([130.0, 100.0], now=160.0), Stop)


def test_restart_long_after_the_deadline_applies_it_at_once() -> None:
    wait = ApprovalWait(timeout_s=60.0, on_timeout="stop")
    stop = wait.at([100.0], now=10_000.0)
    assert isinstance(stop, Stop)
    assert stop.value == 9_900.0


def test_deny_on_timeout_denies_with_the_timed_out_reason() -> None:
    wait = ApprovalWait(timeout_s=5.0, on_timeout="deny")
    decision = wait.at([0.0], now=5.0)
    assert isinstance(decision, TimeoutDeny)
    assert denial_text(decision.reason) == "denied by the operator: approval timed out"


def test_no_pending_call_has_no_deadline() -> None:
    assert ApprovalWait(timeout_s=1.0).at([], now=1e9) is None


def test_denial_text_carries_the_reason() -> None:
    assert denial_text("too expensive") == "denied by the operator: too expensive"
    assert denial_text("  ") == "denied by the operator"
