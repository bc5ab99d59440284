"""The daemon running out of its own descriptors or memory is not a provider outage."""

from __future__ import annotations

import errno

import aiohttp
import pytest
from tests.unit.test_runner import Harness, answer

from turnkeeper.policy.breaker import BreakerState
from turnkeeper.policy.classify import CallFailure, local_exhaustion
from turnkeeper.policy.outcome import StopCode

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _connect_error(code: int) -> aiohttp.ClientConnectorError:
    key = aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 9, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, OSError(code, "Too many open files"))


def test_emfile_inside_a_connect_error_is_local_exhaustion() -> None:
    assert local_exhaustion(_connect_error(errno.EMFILE))
    assert local_exhaustion(OSError(errno.ENFILE, "file table overflow"))


def test_a_refused_connection_is_the_peer_not_us() -> None:
    assert not local_exhaustion(_connect_error(errno.ECONNREFUSED))
    assert not local_exhaustion(TimeoutError())


OURS = CallFailure(exception=("ClientConnectorError", "OSError"),
                   message="Too many open files", local=True)
THEIRS = CallFailure(exception=("ClientConnectorError", "OSError"),
                     message="Connection refused")

# Six failed attempts in a row (more than the breaker's threshold of 5), then an answer.
RETRIES = {"agent": {"api_max_retries": 6}, "retry": {"base_delay": 0.1, "max_delay": 0.1}}


async def test_our_own_emfile_never_opens_the_providers_breaker() -> None:
    h = Harness([OURS] * 6 + [answer()], **RETRIES)
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    breaker = h.shared.breakers["provider:main"]
    assert breaker.state(h.clock.monotonic()) is BreakerState.CLOSED
    assert h.of_type("turn.recovering") == []
    assert len(h.of_type("model.request")) == 7  # every attempt made, none skipped


async def test_the_same_count_of_peer_failures_opens_it() -> None:
    h = Harness([THEIRS] * 6 + [answer()], **RETRIES)
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    # The fifth failure opened the breaker: the sixth attempt was never made, and the
    # turn waited out a recovery cycle instead.
    assert h.of_type("turn.recovering") != []
