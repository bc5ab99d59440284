"""What a model's reply means for the turn, and what a request may ask for.

A reply that arrives whole is not always an answer. The model (or its provider's
content filter) may have declined, which is its own stop; the output cap may have cut
the reply, and a cut answer is never reported as complete: the agent is asked to go on
from where it stopped, a bounded number of times, and past that the turn ends partial
with the cut text. A cut reply that asked for tools has its last call cut too (the
cap fell inside it or right after it, and a provider may hand back the part it had as
if it were whole), so that call is never run: the agent is told, as for any malformed
call. Nothing here reads a wire format: the adapters map theirs to the finish reasons
below.

The thinking rule: a provider that thinks before it answers (Anthropic's extended
thinking) takes its thinking out of the same output cap, and rejects a request whose
cap is not above its thinking budget. The budget sent is lowered to fit under the cap,
never below the provider's minimum; when even that does not fit, the call is not made.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkeeper.policy.outcome import Stop, StopCode

# Finish reasons, as the adapters report them.
FINISH_CUT = "length"  # the output cap ended the reply
FINISH_REFUSED = "refusal"  # the model declined (Anthropic's `refusal` stop reason)
FINISH_FILTERED = "content_filter"  # the provider's content filter ended it

# The smallest thinking budget Anthropic accepts.
MIN_THINKING_BUDGET = 1024

# What the agent is told when its answer was cut and it is asked to go on.
CONTINUE_NOTE = ("your answer was cut off by the output limit. Continue it exactly where "
                 "it stopped, without repeating anything already written; the parts will "
                 "be joined into one answer.")


@dataclass(frozen=True, slots=True)
class Refused:
    """The model declined: the turn ends `model.refused`, with `text` as its answer."""

    stop: Stop
    text: str


@dataclass(frozen=True, slots=True)
class Continue:
    """A cut answer: the agent is asked to go on (continuation `number` of `of`)."""

    number: int
    of: int
    note: str = CONTINUE_NOTE


@dataclass(frozen=True, slots=True)
class Truncated:
    """A cut answer with no continuation left: the turn ends `model.truncated`."""

    stop: Stop


@dataclass(frozen=True, slots=True)
class CutCall:
    """A cut reply that asked for tools: its call at `index` (the last) is not run."""

    index: int
    output_cap: int


@dataclass(frozen=True, slots=True)
class Answered:
    """A whole reply: an answer, or tool calls to run."""


Verdict = Refused | Continue | Truncated | CutCall | Answered
ANSWERED = Answered()


def judge_reply(*, finish_reason: str, tool_calls: int, text: str | None,
                refusal: str | None, provider: str, output_tokens: int, output_cap: int,
                continuations: int, max_continuations: int) -> Verdict:
    """The verdict on one reply. `continuations` is how many times the answer it ends
    was already continued; `output_cap` the cap the request was sent with.

    - a refusal (a refusal text, `refusal`, or `content_filter`) ends the turn, whatever
      else the reply holds: a declined reply's tool calls are not run;
    - a cut reply with tool calls: its last call is cut (`CutCall`);
    - a cut answer: `Continue` while `continuations < max_continuations`, else
      `Truncated` (counter `output_tokens`, value the reply's, limit the cap sent);
    - anything else is `Answered`."""
    if refusal is not None or finish_reason in (FINISH_REFUSED, FINISH_FILTERED):
        return _refused(finish_reason, text, refusal, provider)
    if finish_reason != FINISH_CUT:
        return ANSWERED
    if tool_calls:
        return CutCall(index=tool_calls - 1, output_cap=output_cap)
    if continuations < max_continuations:
        return Continue(number=continuations + 1, of=max_continuations)
    cut = f"{continuations} continuation(s)" if continuations else "no continuation allowed"
    return Truncated(Stop(
        StopCode.MODEL_TRUNCATED,
        f"the answer was cut by the output cap of {output_cap} tokens ({cut}); "
        "the cut text is the answer",
        value=output_tokens, limit=output_cap))


def _refused(finish_reason: str, text: str | None, refusal: str | None, provider: str
             ) -> Refused:
    said = (refusal or text or "").strip()
    if finish_reason == FINISH_FILTERED and refusal is None:
        message = f"provider {provider}'s content filter stopped the answer"
    else:
        message = f"the model of provider {provider} declined to answer"
    if said:
        message += f": {' '.join(said.split())[:200]}"
    return Refused(Stop(StopCode.MODEL_REFUSED, message), said)


def cut_call_message(output_cap: int) -> str:
    """What the agent is told of a call its reply's output cap cut."""
    return (f"not run: your reply was cut by the output limit ({output_cap} tokens) in "
            "or right after this call, so its arguments may be incomplete. Send it again "
            "on its own, with shorter arguments if you can.")


def thinking_budget(*, output_cap: int, budget_tokens: int) -> int | None:
    """The thinking budget to send with a request whose output cap is `output_cap`: the
    configured `budget_tokens` when the cap is above it, else lowered to one below the
    cap, never under `MIN_THINKING_BUDGET`; None when even that does not fit (the call
    is not to be made)."""
    if output_cap > budget_tokens:
        return budget_tokens
    lowered = output_cap - 1
    return lowered if lowered >= MIN_THINKING_BUDGET else None


def thinking_stop(*, output_cap: int, budget_tokens: int, tokens_spent: int,
                  max_tokens: int) -> Stop | None:
    """`budget.tokens` before a call whose output cap (cut to what is left of the token
    budget) cannot hold the smallest thinking budget and an answer; None when it can."""
    if thinking_budget(output_cap=output_cap, budget_tokens=budget_tokens) is not None:
        return None
    return Stop(StopCode.BUDGET_TOKENS,
                f"token budget of {max_tokens} nearly spent: the {output_cap} output tokens "
                f"left cannot hold a thinking budget of at least {MIN_THINKING_BUDGET} "
                "tokens and an answer; no request was sent",
                value=tokens_spent, limit=max_tokens)
