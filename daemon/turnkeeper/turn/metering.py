"""The model call's meter: the size of the next request before it is sent, and what a
reply is charged after.

Both rules are the budget's and the usage's (`policy/budget.py`, `policy/usage.py`);
this room only gathers their inputs from the turn. The request's text is what a
provider is sent of it: the system prompt, each message's content and tool calls (names
and arguments) and the tool specs (name, description, JSON schema). Each part is sized
once: the conversation keeps its messages' size as it grows (`Conversation.tokens`, each
message sized as it joins; a compaction sizes them again), the ToolBox sizes the offer
to each agent once for every turn (`ToolBox.specs_tokens`; a fixed offer, with no MCP
server, is asked once a turn), and the budget's answer is
kept with what it was asked (`preflight`): the step's check and its first attempt's ask
the same question unless something changed between them.
"""

from __future__ import annotations

from typing import Any

from turnkeeper import event_types as ev
from turnkeeper.policy.budget import BudgetGuard, BudgetUsage, Preflight
from turnkeeper.policy.outcome import Stop
from turnkeeper.policy.usage import REQUEST_TOKENS, Prices, item_tokens, metered
from turnkeeper.providers.base import ModelReply
from turnkeeper.settings import ProviderRequestSettings
from turnkeeper.turn.context import TurnContext


def prices_of(settings: ProviderRequestSettings) -> Prices:
    return Prices(settings.price_input_per_mtok, settings.price_output_per_mtok,
                  settings.price_cache_read_per_mtok, settings.price_cache_write_per_mtok)


class Meter:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx
        self._system: tuple[str, int] = ("", 0)
        # The last pre-flight's answer, with what it was asked.
        self._asked: tuple[tuple[Any, ...], Preflight | Stop] | None = None
        # Each provider's prices.
        self._prices: dict[str, Prices] = {}
        # The size of the offer to the turn's agent, when it is fixed (no MCP server):
        # the same for the whole turn, as the agent is.
        self._fixed_offer_tokens: int | None = None

    def input_tokens(self) -> int:
        """The next request's input, estimated on the large side (see the module)."""
        ctx = self.ctx
        system = ctx.agent.system_prompt
        if self._system[0] is not system:
            self._system = (system, item_tokens((system,)))
        toolbox = ctx.runtime.toolbox
        offer = self._fixed_offer_tokens if toolbox.offer_fixed else None
        if offer is None:
            offer = toolbox.specs_tokens(ctx.agent.tools)
            if toolbox.offer_fixed:
                self._fixed_offer_tokens = offer
        return REQUEST_TOKENS + self._system[1] + ctx.conv.tokens + offer

    def preflight(self, provider: str, guard: BudgetGuard | None = None, *,
                  usage: BudgetUsage | None = None) -> Preflight | Stop:
        """The budget's word on the next call to `provider` (`guard`: the turn's own
        unless another is given, e.g. the watched limits of a budget in warn mode;
        `usage`: the turn's as it is, unless the caller has just read it)."""
        ctx = self.ctx
        guard = guard or ctx.guard
        conv, spent = ctx.conv, ctx.record.usage
        # What the answer is made of: the provider (its cap and prices, like the agent's
        # prompt and tool selection, are the turn's, the same for the whole turn), the
        # limits (a guard's are replaced, never changed, when extended), what was spent,
        # and what the request is made of (the conversation, and the offer the agent's
        # tools are taken from: a fixed one is its toolbox's); not the time. The same
        # question, the same answer.
        toolbox = ctx.runtime.toolbox
        key = (provider, guard, guard.limits, spent.input_tokens, spent.output_tokens,
               spent.cost_usd, conv, conv.revision,
               toolbox if toolbox.offer_fixed else toolbox.specs)
        last = self._asked
        if last is not None and last[0] == key:
            return last[1]
        settings = ctx.settings.providers[provider]
        prices = self._prices.get(provider) or self._prices_of(provider)
        answer = guard.preflight(usage or ctx.usage(), input_tokens=self.input_tokens(),
                                 max_output_tokens=settings.max_output_tokens, prices=prices)
        self._asked = (key, answer)
        return answer

    def _prices_of(self, provider: str) -> Prices:
        """The provider's prices, read once: a turn's settings stay as they are."""
        prices = self._prices.get(provider)
        if prices is None:
            prices = self._prices[provider] = prices_of(self.ctx.settings.providers[provider])
        return prices

    def charge(self, provider: str, reply: ModelReply) -> str | None:
        """Charge the reply's usage to the turn, and publish `model.response`; what is
        wrong with the usage instead, charging nothing, when it is not one a provider
        could really have used."""
        u = reply.usage
        counted = metered(u.input_tokens, u.output_tokens, u.cache_read_tokens,
                          u.cache_write_tokens,
                          prices=self._prices.get(provider) or self._prices_of(provider))
        if isinstance(counted, str):
            return counted
        ctx = self.ctx
        usage = ctx.record.usage
        usage.input_tokens += counted.input_tokens
        usage.output_tokens += counted.output_tokens
        usage.cost_usd = round(usage.cost_usd + counted.cost_usd, 9)
        ctx.bus.publish(ev.ModelResponse(
            provider=provider, usage={"input_tokens": counted.input_tokens,
                                      "output_tokens": counted.output_tokens},
            cost_usd=round(counted.cost_usd, 9), finish_reason=reply.finish_reason,
            tool_calls=len(reply.tool_calls)), turn=ctx.record.id)
        return None
