"""A vLLM engine that stops giving outputs with requests in flight is taken as hung; an idle one never is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.vllm import engine as engine_module
from services.node_agent.engines.vllm.engine import VllmEngine
from services.node_agent.engines.vllm.progress import ProgressWatch


def test_an_engine_is_hung_only_with_requests_in_flight_and_no_output_past_the_limit() -> None:
    """A stopped engine core held its streams as long as their clients waited and took every new request, since
    only its death was watched (helper-191)."""
    watch = ProgressWatch(hung_after_s=60.0)
    assert watch.hung_s(1000.0, 0) is None  # idle for ever: not hung
    watch.admitted(1000.0, 0)  # the first request after a long idle starts the clock
    assert watch.hung_s(1059.0, 1) is None
    watch.output(1050.0)
    assert watch.hung_s(1109.0, 1) is None
    assert watch.hung_s(1111.0, 1) == pytest.approx(61.0)
    watch.admitted(1111.0, 1)  # another admitted beside a stuck one does not reset the clock
    assert watch.hung_s(1112.0, 2) == pytest.approx(62.0)
    assert watch.hung_s(1112.0, 0) is None  # all aborted: nothing in flight
    assert ProgressWatch(hung_after_s=0.0).hung_s(10_000.0, 5) is None  # 0: never


def test_requests_that_left_with_no_output_count_on_into_the_next_so_a_hang_is_found_whatever_the_clients_wait(
) -> None:
    """Each admission to an empty engine started the clock afresh: with clients that gave up after 25 s, a stopped
    engine core was never taken as hung and took every request placed there for 125 s (helper-203)."""
    watch = ProgressWatch(hung_after_s=60.0)
    watch.admitted(0.0, 0)
    watch.left(25.0, 0)  # its client gave up: no output came
    assert watch.hung_s(39.0, 0) is None  # nothing in flight
    watch.admitted(40.0, 0)
    assert watch.hung_s(74.0, 1) is None  # 25 + 34 s
    assert watch.hung_s(76.0, 1) == pytest.approx(61.0)
    # A healthy engine: an output, then the request ends; a long idle later is nobody's.
    healthy = ProgressWatch(hung_after_s=60.0)
    healthy.admitted(0.0, 0)
    healthy.output(1.0)
    healthy.left(1.5, 0)
    healthy.admitted(1000.0, 0)
    assert healthy.hung_s(1059.0, 1) is None


def test_time_the_watcher_did_not_run_is_not_the_engines() -> None:
    """A node agent paused 65 s with a stream in flight took its healthy engine for hung as it woke, before it had
    read the outputs of that time, and exited (helper-203)."""
    watch = ProgressWatch(hung_after_s=60.0)
    watch.admitted(0.0, 0)
    watch.not_watched(65.0, 64.0)  # the watcher woke at 65 s, 64 s late
    assert watch.hung_s(65.0, 1) is None
    assert watch.hung_s(125.5, 1) == pytest.approx(61.5)  # and no output since: hung
    # An output read as the process woke restarted the clock: the pause is not added on top of it (helper-205).
    woke = ProgressWatch(hung_after_s=3.0)
    woke.admitted(0.0, 0)
    woke.output(5.5)
    woke.not_watched(5.6, 5.0)
    assert woke.hung_s(8.7, 1) == pytest.approx(3.1)


def test_what_requests_with_no_output_carried_lapses_once_the_engine_was_idle_for_the_limit() -> None:
    """Carried for good, six long prefills an hour apart whose clients gave up after 10 s added up to a healthy
    engine taken as hung 1 s into the next (helper-205)."""
    watch = ProgressWatch(hung_after_s=60.0)
    for hour in range(6):
        watch.admitted(hour * 3600.0, 0)
        watch.left(hour * 3600.0 + 10.0, 0)
    watch.admitted(6 * 3600.0, 0)
    assert watch.hung_s(6 * 3600.0 + 50.0, 1) is None


def _watched(monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> str:
    """What the engine's watch loop raised, one request in flight from 0 s with no output and a limit of 60 s, each of
    its waits taking the next of sleeps (a clock it is given, not the event loop's); its engine core dies after
    them."""
    clock = [0.0]
    vllm = VllmEngine.__new__(VllmEngine)
    vllm.model, vllm._requests = "m", {"r": object()}
    vllm._llm = SimpleNamespace(errored=False, dead_error="gone")
    vllm._progress = ProgressWatch(hung_after_s=60.0)
    vllm._progress.admitted(0.0, 0)
    waits = iter(sleeps)

    async def sleep(_: float) -> None:
        clock[0] += next(waits, 0.0)
        vllm._llm.errored = clock[0] >= sum(sleeps)

    monkeypatch.setattr(engine_module, "asyncio", SimpleNamespace(
        sleep=sleep, get_running_loop=lambda: SimpleNamespace(time=lambda: clock[0])))
    watching = vllm._watch_engine_core()
    with pytest.raises(RuntimeError) as raised:
        watching.send(None)  # its waits never suspend it: it runs to its end in one go
    return str(raised.value)


def test_the_engines_watch_does_not_count_its_own_pause_as_the_engines_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node agent's process paused 65 s (SIGSTOP) with a stream in flight: as it woke, its watch took its healthy
    engine for hung and the agent exited (helper-203). Now the pause is nobody's, and a hang after it is still found."""
    paused = [1.0, 1.0, 65.0] + [1.0] * 5
    assert _watched(monkeypatch, paused) == "vLLM engine core of m died: gone"
    # At 125 s exactly: the pause less one look is forgiven.
    assert "gave no output for 61 s" in _watched(monkeypatch, paused + [1.0] * 53)
    assert "gave no output for 61 s" in _watched(monkeypatch, [1.0] * 70)  # unpaused: hung at 61 s


def test_the_hung_limit_is_zero_or_more() -> None:
    assert NodeAgentConfig(engine_hung_s=0.0).engine_hung_s == 0.0
    with pytest.raises(ValueError, match=r"--engine-hung-s: must be 0 \(never\) or more, got -1"):
        NodeAgentConfig(engine_hung_s=-1.0)
