"""What a policy version runs with: its providers and tools (`Runtime`), and the
daemon-wide protection shared by every turn and every policy version (`Shared`: circuit
breakers, retry budgets, in-flight gates and the Retry-After windows peers asked for,
which survive a reload for unchanged providers and tools; the event loop's share for
turn work, `LoopGate`)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic

from turnkeeper.concurrency import ProviderGates
from turnkeeper.config import (
    Config,
    ConfigError,
    PolicyVersion,
    ProviderConfig,
    ProviderSecrets,
    ToolConfig,
)
from turnkeeper.policy.breaker import BreakerChange, CircuitBreaker
from turnkeeper.policy.loop_share import LoopShare
from turnkeeper.policy.retry_after import RetryAfterMemory
from turnkeeper.policy.retry_budget import RetryBudget
from turnkeeper.policy.stall import StallWatch
from turnkeeper.providers.base import Provider
from turnkeeper.providers.prices import check_cost_limits, priced, unpriced
from turnkeeper.settings import TurnSettings
from turnkeeper.tools.registry import ToolBox
from turnkeeper.tracing import NOOP, Tracer


def make_provider(cfg: ProviderConfig, secrets: ProviderSecrets | None = None) -> Provider:
    """The adapter for `cfg`, sending `secrets` (None: read them now)."""
    if cfg.kind == "scripted":
        from turnkeeper.providers.scripted import ScriptedProvider
        return ScriptedProvider(cfg)
    if cfg.kind == "openai":
        from turnkeeper.providers.openai import OpenAIProvider
        return OpenAIProvider(cfg, secrets)
    if cfg.kind == "openai-responses":
        from turnkeeper.providers.openai_responses import ResponsesProvider
        return ResponsesProvider(cfg, secrets)
    if cfg.kind == "gemini":
        from turnkeeper.providers.gemini import GeminiProvider
        return GeminiProvider(cfg, secrets)
    from turnkeeper.providers.anthropic import AnthropicProvider
    return AnthropicProvider(cfg, secrets)


def _script_digest(cfg: ProviderConfig) -> str:
    """What a scripted provider answers from: its script's bytes. A reload re-reads the
    script, as it re-reads keys, and builds the provider anew when it changed, even with
    the config text the same (the built-in demo script does not change)."""
    if not cfg.script:
        return "demo"
    try:
        return hashlib.sha256(Path(cfg.script).read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"script {cfg.script} cannot be read: {exc.strerror}") from None


@dataclass(slots=True)
class Runtime:
    policy: PolicyVersion
    providers: dict[str, Provider]
    toolbox: ToolBox
    # Per provider, a digest of the secrets it was built with: a reload that reads other
    # ones (a rotated key) builds the provider anew. Digests, so no key is kept twice.
    secret_digests: dict[str, str] = field(default_factory=dict, repr=False)
    # What turns read from the policy, resolved once here rather than on every step; the
    # prices are those in force (configured, else the shipped table).
    settings: TurnSettings = field(init=False, repr=False)

    # The providers with no price (none configured, none in the shipped table): a submit
    # may not set a cost limit over a chain that holds one.
    unpriced: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.settings = TurnSettings.from_config(priced(self.policy.config))
        self.unpriced = unpriced(self.policy.config)

    @property
    def config(self) -> Config:
        return self.policy.config

    @classmethod
    def build(cls, policy: PolicyVersion, previous: Runtime | None = None) -> Runtime:
        """Providers whose config and secrets (a scripted one: its script) did not change
        keep their instance (and its connection pool); the rest are built new. Secrets
        (keys, `env:` header and query values) and scripts are read again on every
        build, so a rotated key or an edited script takes effect on reload even when the
        config text is the same. Raises ConfigError (e.g. an unreadable script or key
        file, or a cost limit over a provider with no price)."""
        check_cost_limits(policy.config, policy.source_path or "embedded defaults")
        old = {p.name: p for p in previous.config.providers} if previous else {}
        providers: dict[str, Provider] = {}
        digests: dict[str, str] = {}
        held: list[str] = []
        for p in policy.config.providers:
            secrets = p.secrets() if p.kind != "scripted" else ProviderSecrets()
            held.extend(p.secret_values(secrets))
            digests[p.name] = digest = (secrets.digest() if p.kind != "scripted"
                                        else _script_digest(p))
            if (previous is not None and old.get(p.name) == p
                    and previous.secret_digests.get(p.name) == digest):
                providers[p.name] = previous.providers[p.name]
            else:
                providers[p.name] = make_provider(p, secrets)
        # MCP servers whose config did not change keep running, as providers do.
        # Tool results are cleaned of every secret the daemon holds, the providers' too.
        toolbox = ToolBox(policy.config.tools,
                          previous=previous.toolbox if previous is not None else None,
                          secrets=held)
        return cls(policy=policy, providers=providers, toolbox=toolbox,
                   secret_digests=digests)

    def retired_by(self, new: Runtime) -> list[Provider]:
        """Providers of this runtime that `new` does not use any more."""
        keep = {id(p) for p in new.providers.values()}
        return [p for p in self.providers.values() if id(p) not in keep]


class LoopGate:
    """Turn work's share of each turn of the event loop, as `policy/loop_share.py`
    decides: every step asks before it starts (`through()`; the runner calls its two
    parts, `passes()` then, only when it did not pass, `held_through()`, so a step that
    goes through makes no coroutine). It goes through at once while the current turn of
    the loop has share left and nobody is held (nothing awaited: no extra turn of the
    loop), and otherwise is held for a later turn, first come first through; a turn that
    went through in this same turn of the loop goes on past held ones while the share
    lasts (`passes(last)`). A callback at the start of the next turn (one per turn of
    the loop in which a step asked) ends the turn for the rule, counts it (`turn`) and
    lets held steps out."""

    __slots__ = ("_held", "_marked", "_now", "held", "rule", "turn")

    def __init__(self, rule: LoopShare | None = None, *,
                 now: Callable[[], float] = monotonic) -> None:
        self.rule = rule if rule is not None else LoopShare()
        self._now = now  # the loop's own time: what a turn of the loop spends
        self._held: deque[asyncio.Future[None]] = deque()
        self._marked = False  # the next turn's callback is scheduled
        self.held = 0  # steps held for a later turn, ever (`turnkeeper_loop_held_total`)
        self.turn = 0  # the turns of the loop the rule has seen end

    @property
    def waiting(self) -> int:
        """Steps held now (one cancelled while held counts until it would be let out)."""
        return len(self._held)

    async def through(self) -> None:
        """Return when this step's work may run: at once, or in a later turn."""
        if not self.passes():
            await self.held_through()

    def passes(self, last: int = -1) -> bool:
        """Whether this step's work may run at once (counted as let through); if not,
        it must await `held_through()`. `through()` in two parts: a step that goes
        through at once (most of them) makes no coroutine. `last`: the gate's `turn`
        when the asker last went through. In that same turn of the loop it asks again
        (its step awaited nothing that suspended it), and goes on while the share lasts
        even with others held: it was let through in this turn, and holding it would
        only let one more out in its place."""
        again = last == self.turn
        if (again or not self._held) and self.rule.ask(self._now(), again=again):
            if not self._marked:
                self._marked = True
                asyncio.get_running_loop().call_soon(self._next_turn)
            return True
        return False

    async def held_through(self) -> None:
        """Return when this step, which did not pass, may run: in a later turn."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._held.append(waiter)
        self.held += 1
        if not self._marked:
            self._marked = True
            loop.call_soon(self._next_turn)
        await waiter
        self.rule.let_in(self._now())

    def _next_turn(self) -> None:
        self._marked = False
        self.turn += 1
        rule = self.rule
        rule.next_turn()
        held = self._held
        let_out = rule.to_let_out(len(held))
        woken = 0
        while woken < let_out and held:
            waiter = held.popleft()
            if not waiter.done():  # else cancelled while held: gone
                waiter.set_result(None)
                woken += 1
        if held or woken:  # those let out run in the next turn: the rule hears it end
            self._marked = True
            asyncio.get_running_loop().call_soon(self._next_turn)


@dataclass(slots=True)
class Shared:
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)
    retry_budgets: dict[str, RetryBudget] = field(default_factory=dict)
    # Per provider, the limit on model calls in flight (fixed, or adaptive) and its queue.
    gates: ProviderGates = field(default_factory=ProviderGates)
    # What each provider and tool asked in a Retry-After, by its breaker's name.
    retry_after: RetryAfterMemory = field(default_factory=RetryAfterMemory)
    # The config each breaker was made for: a provider or tool whose config changed is a
    # new peer (another URL, model or key), and starts with a closed breaker.
    _made_for: dict[str, ProviderConfig | ToolConfig] = field(default_factory=dict)
    # Hears every breaker's changes (in a fleet: to share the streak), new ones too.
    breaker_observer: Callable[[BreakerChange], None] | None = None
    # When the process did not run (or its fleet lease lapsed): a call that failed across
    # such a time feeds no breaker and no retry budget (`policy/stall.py`).
    stalls: StallWatch = field(default_factory=StallWatch)
    # Where the turns' spans go: nowhere (`NOOP`) unless `[tracing] enabled`, when the
    # daemon puts the OpenTelemetry tracer here at boot.
    tracer: Tracer = NOOP
    # Turn work's share of each turn of the event loop (`policy/loop_share.py`).
    loop_gate: LoopGate = field(default_factory=LoopGate)

    def observe_breakers(self, observer: Callable[[BreakerChange], None] | None) -> None:
        self.breaker_observer = observer
        for breaker in self.breakers.values():
            breaker.observer = observer

    def apply(self, config: Config) -> None:
        """Create or reconfigure the breaker and retry budget of every provider and http
        tool. The breaker of an unchanged provider or tool keeps its state (it
        survives a reload); a changed one starts closed. Retry budgets keep their counts:
        they are in-flight bookkeeping, not a judgement of the peer."""
        cb, rb = config.circuit_breaker, config.retry_budget
        peers: dict[str, ProviderConfig | ToolConfig] = {
            f"provider:{p.name}": p for p in config.providers}
        peers.update({t.breaker: t for t in config.tools if t.kind in ("http", "mcp")})
        names = list(peers)
        for name in names:
            breaker = self.breakers.get(name)
            if breaker is not None and self._made_for.get(name) != peers[name]:
                breaker = None
                self.retry_after.forget(name)  # another peer: the old one's word is void
            self._made_for[name] = peers[name]
            if breaker is None:
                self.breakers[name] = CircuitBreaker(
                    name, failure_threshold=cb.failure_threshold, cooldown_s=cb.cooldown,
                    half_open_probes=cb.half_open_probes)
                self.breakers[name].observer = self.breaker_observer
            else:
                breaker.reconfigure(failure_threshold=cb.failure_threshold,
                                    cooldown_s=cb.cooldown,
                                    half_open_probes=cb.half_open_probes)
        for p in config.providers:
            budget = self.retry_budgets.get(p.name)
            if budget is None:
                self.retry_budgets[p.name] = RetryBudget(ratio=rb.ratio,
                                                         min_concurrency=rb.min_concurrency)
            else:
                budget.reconfigure(ratio=rb.ratio, min_concurrency=rb.min_concurrency)
        for gone in set(self.breakers) - set(names):
            del self.breakers[gone]
            self._made_for.pop(gone, None)
        for gone in set(self.retry_after.names()) - set(names):
            self.retry_after.forget(gone)
        for gone in set(self.retry_budgets) - {p.name for p in config.providers}:
            del self.retry_budgets[gone]
        self.gates.apply(config)
