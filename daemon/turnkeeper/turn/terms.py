"""The terms the policy in force sets a turn when its run begins: its guards (its budget
profile's), their modes, its provider chain, its base budget limits and its agent.

A reload may have removed what the turn was submitted with since: a budget profile
leaves it to the plain sections, a model to the default chain, an agent to the default
agent. The turn goes on, and says so (a log line; for the agent, an event too).
"""

from __future__ import annotations

from typing import Any

import structlog

from turnkeeper.clock import Clock
from turnkeeper.config import GuardConfig
from turnkeeper.event_types import TurnAgentRemoved
from turnkeeper.policy.agents import AgentDefinition
from turnkeeper.policy.budget import BudgetLimits
from turnkeeper.runtime import Runtime
from turnkeeper.settings import ChainSettings
from turnkeeper.turn.record import TurnRecord
from turnkeeper.values import value_class

log = structlog.get_logger("turnkeeper.turn")


def turn_log(record: TurnRecord) -> Any:
    """The turn's logger: each line names the turn, its session and its policy."""
    return log.bind(turn=record.id, session=record.session,
                    policy_version=record.policy_version)


@value_class
class Terms:
    """What the policy in force sets a turn: its guards (its profile's), their modes,
    its provider chain, its base budget limits and its agent (`agent_removed`: the event
    that says a reload removed the one it was submitted as)."""

    guards: GuardConfig
    modes: dict[str, str]
    chain: ChainSettings
    base_limits: BudgetLimits
    agent: AgentDefinition
    agent_removed: TurnAgentRemoved | None


def terms_in_force(record: TurnRecord, runtime: Runtime, clock: Clock) -> Terms:
    """The turn's terms under the policy in force (the record's first start, its
    profile, model and agent set as they apply)."""
    guards = runtime.config.guards(_profile_in_force(record, runtime))
    if record.started_at is None:  # its first start: the wall clock begins
        record.started_at = clock.time()
    limits = BudgetLimits.from_config(guards.budget, overrides=record.budget,
                                      deadline=record.deadline,
                                      started_at=record.started_at)
    chain = _chain_in_force(record, runtime)
    agent, removed = _agent_in_force(record, runtime)
    return Terms(guards, guards.modes, chain, limits, agent, removed)


def _profile_in_force(record: TurnRecord, runtime: Runtime) -> str | None:
    """The turn's budget profile; None when a reload removed it (the turn goes on under
    the plain sections, and says so)."""
    if record.profile is not None and record.profile not in runtime.config.budget.profiles:
        turn_log(record).warning("turn.profile_gone", profile=record.profile)
        record.profile = None
    return record.profile


def _chain_in_force(record: TurnRecord, runtime: Runtime) -> ChainSettings:
    """The turn's provider chain; the default one when a reload removed the model it was
    submitted with (and it says so)."""
    chain = runtime.settings.chain_for(record.model)
    if chain is None:
        turn_log(record).warning("turn.model_gone", model=record.model)
        record.model = None
        chain = runtime.settings.chain
    return chain


def _agent_in_force(record: TurnRecord, runtime: Runtime
                    ) -> tuple[AgentDefinition, TurnAgentRemoved | None]:
    """The agent the turn runs as, as this policy defines it: kept for as long as the
    turn runs under this policy (a reload's new definition applies when the turn resumes
    under the next one, at a step boundary, as the policy does). An agent the policy no
    longer defines (a reload removed it) leaves the turn to the default agent, and the
    turn says so (the event returned beside it)."""
    settings = runtime.settings
    agent = settings.agent(record.agent)
    if agent is not None:
        return agent, None
    turn_log(record).warning("turn.agent_removed", agent=record.agent)
    removed = TurnAgentRemoved(agent=str(record.agent), policy_version=record.policy_version)
    record.agent = None
    return settings.default_agent, removed
