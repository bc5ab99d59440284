"""Which reloads let parked turns wait on through the drain (`waits_hold`): those that
leave every bound of a parked wait where it was."""

from __future__ import annotations

from turnkeeper.config import Config
from turnkeeper.supervisor.lifecycle import waits_hold


def config(**sections: object) -> Config:
    return Config(**sections)  # type: ignore[arg-type]


def test_a_change_elsewhere_keeps_the_waits() -> None:
    running = config()
    assert waits_hold(running, config(daemon={"body_read_timeout": 11.0},
                                      agent={"recovery_schedule": [1.0]}))
    assert waits_hold(running, config())


def test_a_change_of_what_bounds_a_wait_does_not() -> None:
    running = config()
    assert not waits_hold(running, config(clarify={"timeout": 5.0}))
    assert not waits_hold(running, config(approvals={"timeout": 5.0}))
    assert not waits_hold(running, config(budget={"max_wall_seconds": 60.0}))
