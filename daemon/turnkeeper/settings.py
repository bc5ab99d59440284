"""What a turn reads from its policy, typed and built once per policy version.

The runner used to reach into `runtime.config` wherever it needed a number; these frozen
objects are that same data, resolved when the policy is loaded (`Runtime.build`), so a
turn's rooms take exactly what they use and a test can hand them settings without a
whole config. Guard limits stay per turn: they depend on the turn's budget profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from turnkeeper.config import Config, FailureLoopConfig, LoopDetectionConfig
from turnkeeper.policy.agents import AgentDefinition
from turnkeeper.policy.approvals import ApprovalSetting, ApprovalWait
from turnkeeper.policy.backoff import Backoff, Rand
from turnkeeper.policy.chain import ProviderChain
from turnkeeper.policy.failure_loop import FailureLoop
from turnkeeper.policy.loops import LoopDetector
from turnkeeper.policy.output import mode_of
from turnkeeper.policy.tool_retry import ToolRetry
from turnkeeper.policy.tool_traits import NAME_SEPARATOR


@dataclass(frozen=True, slots=True)
class ProviderRequestSettings:
    """What one provider's requests and charges need."""

    timeout_s: float
    max_output_tokens: int
    price_input_per_mtok: float
    price_output_per_mtok: float
    # None: the provider bills cache reads and writes at its input price.
    price_cache_read_per_mtok: float | None = None
    price_cache_write_per_mtok: float | None = None
    # The extended-thinking budget configured (Anthropic), None without one: the output
    # cap sent must stay above what is sent of it.
    thinking_budget_tokens: int | None = None
    # The longest one call may take, start to end, whatever it streams.
    max_call_s: float = 600.0
    # How a turn with an output schema asks this provider for it, `auto` resolved by
    # kind: "native", "tool" or "prompt".
    structured_output: str = "native"


@dataclass(frozen=True, slots=True)
class ChainSettings:
    """How a turn walks its provider chain: attempts per provider, backoff, the longest
    Retry-After honoured, and the recovery cycles once every provider has failed."""

    providers: tuple[str, ...]
    max_attempts: int
    backoff: Backoff
    max_retry_after_s: float
    recovery_schedule: tuple[float, ...]
    recovery_jitter: float
    auto_recovery_cycles: int

    def _kwargs(self, rand: Rand) -> dict[str, Any]:
        return {"max_attempts": self.max_attempts, "backoff": self.backoff,
                "max_retry_after_s": self.max_retry_after_s,
                "recovery_schedule": self.recovery_schedule,
                "recovery_jitter": self.recovery_jitter,
                "auto_recovery_cycles": self.auto_recovery_cycles, "rand": rand}

    def new_chain(self, rand: Rand) -> ProviderChain:
        return ProviderChain(self.providers, **self._kwargs(rand))

    def restore_chain(self, snapshot: Mapping[str, Any] | None, rand: Rand) -> ProviderChain:
        """The checkpointed chain; when a reload changed the provider list since, the
        same chain carried over to the new list (a new pass, the same recovery cycles)."""
        if not snapshot:
            return self.new_chain(rand)
        if list(snapshot.get("providers") or ()) == list(self.providers):
            return ProviderChain.restore(dict(snapshot), providers=self.providers,
                                         **self._kwargs(rand))
        return ProviderChain.carry_over(dict(snapshot), self.providers, **self._kwargs(rand))


@dataclass(frozen=True, slots=True)
class ToolCallSettings:
    """How a turn treats tool calls: the retry rule, the attempts an idempotent call may
    take (`[tools_retry] max_attempts`, or a tool's own), and the tools that promise to
    dedupe Idempotency-Keys. Never the provider's `api_max_retries`: a model call and a
    tool call fail for different reasons and are counted apart."""

    retry: ToolRetry
    default_max_attempts: int
    max_attempts_by_tool: Mapping[str, int]
    deduping_tools: frozenset[str]
    # `[[tools]] approval` of each configured tool that is not "never" (an MCP server's
    # for every tool it offers, `server__tool`).
    approval_by_tool: Mapping[str, ApprovalSetting] = field(default_factory=dict)

    def approval(self, tool: str) -> ApprovalSetting:
        """The approval setting of `tool` ("never" unless its `[[tools]]` entry, or its
        MCP server's, says otherwise)."""
        setting = self.approval_by_tool.get(tool)
        if setting is None and NAME_SEPARATOR in tool:
            setting = self.approval_by_tool.get(tool.partition(NAME_SEPARATOR)[0])
        return setting or "never"

    def max_attempts(self, tool: str) -> int:
        """Attempts one call of `tool` may take when it is idempotent (an MCP tool, not
        in the config's list, takes the section's)."""
        return self.max_attempts_by_tool.get(tool, self.default_max_attempts)

    def dedupes_keys(self, tool: str) -> bool:
        return tool in self.deduping_tools

    @classmethod
    def from_config(cls, cfg: Config, backoff: Backoff) -> ToolCallSettings:
        return cls(retry=ToolRetry(backoff=backoff,
                                   max_retry_after_s=cfg.retry.max_retry_after),
                   default_max_attempts=cfg.tools_retry.max_attempts,
                   max_attempts_by_tool={t.name: cfg.tool_max_attempts(t)
                                         for t in cfg.tools},
                   deduping_tools=frozenset(t.name for t in cfg.tools if t.dedupes_keys),
                   approval_by_tool={t.name: t.approval for t in cfg.tools
                                     if t.approval != "never"})


@dataclass(frozen=True, slots=True)
class TurnSettings:
    # The agent of a submit that names none (`[agent]`), and the named ones
    # (`[agents.NAME]`), each resolved over it.
    default_agent: AgentDefinition
    clarify_timeout_s: float
    max_restarts: int
    max_continuations: int
    tools: ToolCallSettings
    providers: Mapping[str, ProviderRequestSettings]
    chain: ChainSettings
    # How long calls held for approval wait, and what their timeout does.
    approvals: ApprovalWait = field(default_factory=lambda: ApprovalWait(timeout_s=86400.0))
    # The chains a submit may choose with `model`: each `[models.NAME]` alias and each
    # provider alone, walked with the same attempts, backoff and recovery as `chain`.
    model_chains: Mapping[str, ChainSettings] = field(default_factory=dict)
    agents: Mapping[str, AgentDefinition] = field(default_factory=dict)

    @property
    def system_prompt(self) -> str:
        """The default agent's system prompt."""
        return self.default_agent.system_prompt

    def agent(self, name: str | None) -> AgentDefinition | None:
        """The agent a turn submitted with `name` runs as (None: the default agent);
        None when the policy no longer knows the name (a reload removed it)."""
        return self.default_agent if name is None else self.agents.get(name)
    # The answers checked against an output schema before the turn stops `output.invalid`.
    max_output_attempts: int = 3

    def output_schema_for(self, submitted: Mapping[str, Any] | None,
                          agent: AgentDefinition) -> Mapping[str, Any] | None:
        """The schema a turn's final answer must match: the submit's, else its agent's;
        None for free text. The one place that decides it."""
        return submitted if submitted is not None else agent.output_schema

    def chain_for(self, model: str | None) -> ChainSettings | None:
        """The chain of a turn submitted with `model` (None: the default chain); None
        when the policy no longer knows the name (a reload removed the alias)."""
        return self.chain if model is None else self.model_chains.get(model)

    @classmethod
    def from_config(cls, cfg: Config) -> TurnSettings:
        backoff = Backoff.from_config(cfg.retry)
        chain = ChainSettings(
            providers=cfg.model_chain(None),
            max_attempts=cfg.agent.api_max_retries + 1, backoff=backoff,
            max_retry_after_s=cfg.retry.max_retry_after,
            recovery_schedule=tuple(cfg.agent.recovery_schedule),
            recovery_jitter=cfg.agent.recovery_jitter,
            auto_recovery_cycles=cfg.agent.auto_recovery_cycles)
        default_agent, agents = cfg.agent_definitions()
        return cls(
            default_agent=default_agent, agents=agents,
            clarify_timeout_s=cfg.clarify.timeout,
            max_restarts=cfg.agent.max_restarts,
            max_continuations=cfg.agent.max_continuations,
            approvals=ApprovalWait(timeout_s=cfg.approvals.timeout,
                                   on_timeout=cfg.approvals.on_timeout),
            max_output_attempts=cfg.agent.max_output_attempts,
            tools=ToolCallSettings.from_config(cfg, backoff),
            providers={p.name: ProviderRequestSettings(
                timeout_s=p.timeout, max_output_tokens=p.max_output_tokens,
                price_input_per_mtok=p.price_input_per_mtok,
                price_output_per_mtok=p.price_output_per_mtok,
                price_cache_read_per_mtok=p.price_cache_read_per_mtok,
                price_cache_write_per_mtok=p.price_cache_write_per_mtok,
                thinking_budget_tokens=p.thinking_budget_tokens,
                max_call_s=p.max_call_seconds,
                structured_output=mode_of(p.kind, p.structured_output))
                for p in cfg.providers},
            chain=chain,
            model_chains={name: replace(chain, providers=cfg.model_chain(name))
                          for name in cfg.model_names()})


def loop_detector(cfg: LoopDetectionConfig, snapshot: Mapping[str, Any] | None = None,
                  lines: Sequence[str] = ()) -> LoopDetector:
    kwargs = {"warn_repeats": cfg.warn_repeats, "max_repeats": cfg.max_repeats,
              "max_state_revisits": cfg.max_state_revisits,
              "max_no_progress": cfg.max_no_progress}
    return (LoopDetector(**kwargs) if snapshot is None
            else LoopDetector.restore(snapshot, lines, **kwargs))


def failure_loop(cfg: FailureLoopConfig, snapshot: Mapping[str, Any] | None = None
                 ) -> FailureLoop:
    kwargs = {"deterministic": cfg.deterministic, "unknown": cfg.unknown,
              "retryable": cfg.retryable}
    return FailureLoop(**kwargs) if snapshot is None else FailureLoop.restore(snapshot,
                                                                              **kwargs)
