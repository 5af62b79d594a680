"""What listeners ask of the ranks' spans (``ddpwatch.control.span_requests``) and what the dashboard asks."""

from __future__ import annotations

from msgspec.structs import replace
from typing import Any

import pytest
from synthetic_session import session_messages

from dashboard_pilot import draw_every_message
from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.control.span_requests import (
    LARGE_JOB_DEVICE_EVERY_S,
    RESEND_EVERY_S,
    RETRY_AFTER_S,
    SAMPLE_EVERY_STEPS,
    SpanRequester,
    SpanWish,
)
from instrumented_ddp.wire.codec import Envelope, decode
from instrumented_ddp.wire.messages import Heartbeat, SpanRequest, StepReport, SwitchCommand


class Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, SpanRequest]] = []

    def send(self, peer: bytes, data: bytes) -> bool:
        self.sent.append((peer, decode(data).message))  # type: ignore[arg-type]
        return True


def heard(requester: SpanRequester, rank: int) -> None:
    requester.note(f"peer-{rank}".encode(), Envelope(Heartbeat(rank, 0.0, 1), rank, 0, 0))


def test_each_rank_heard_from_gets_its_request_again_only_when_it_changes_or_is_due() -> None:
    outbox = Outbox()
    requester = SpanRequester(outbox.send)
    for rank in (0, 1, 2):
        heard(requester, rank)
    requester.note(b"switch-client", Envelope(SwitchCommand("c", "ddp"), -1, 0, 0))  # not a rank
    assert requester.tick(now=10.0) == 3 and [m for _, m in outbox.sent] == [SpanRequest(full=True)] * 3
    assert requester.tick(now=10.5) == 0
    requester.want(SpanWish.sampled(20, full_ranks={1}, pinned_steps={7}, pinned_ranks={1, 2}))
    outbox.sent.clear()
    assert requester.tick(now=11.0) == 3
    assert dict(outbox.sent) == {b"peer-0": SpanRequest(False, 20, []), b"peer-1": SpanRequest(True, 20, [7]),
                                 b"peer-2": SpanRequest(False, 20, [7])}
    assert requester.tick(now=11.0 + RESEND_EVERY_S / 2) == 0
    assert requester.tick(now=11.0 + RESEND_EVERY_S) == 3  # repeated: a rank that missed it is set right


def test_between_changes_a_tick_looks_at_no_rank_and_a_refused_send_is_retried_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver ticks ~50 times a second: at 1,024 ranks a pass over every rank each time was
    7 % of the receiver process. A new rank, a new wish or a due resend still go out at once."""
    looked: list[int] = []
    request_for = SpanWish.request_for
    def counted(wish: SpanWish, rank: int) -> Any:
        looked.append(rank)
        return request_for(wish, rank)

    monkeypatch.setattr(SpanWish, "request_for", counted)
    outbox, refused = Outbox(), {b"peer-1"}
    requester = SpanRequester(lambda peer, data: peer not in refused and outbox.send(peer, data))
    for rank in (0, 1):
        heard(requester, rank)
    assert requester.tick(now=5.0) == 1 and looked == [0, 1]  # rank 1's queue would not take it
    looked.clear()
    assert requester.tick(now=5.0 + RETRY_AFTER_S / 2) == 0 and looked == []
    refused.clear()
    assert requester.tick(now=5.0 + RETRY_AFTER_S) == 1 and looked == [0, 1]  # rank 1 at last
    looked.clear()
    assert requester.tick(now=6.0) == 0 and looked == []
    heard(requester, 2)
    assert requester.tick(now=6.1) == 1 and outbox.sent[-1][0] == b"peer-2"
    requester.want(SpanWish.sampled(10))
    assert requester.tick(now=6.2) == 3


def test_a_pinned_step_without_ranks_named_goes_to_every_rank() -> None:
    wish = SpanWish.sampled(5, full_ranks=(), pinned_steps=(9, 3))
    assert [wish.request_for(rank) for rank in (0, 40)] == [SpanRequest(False, 5, [3, 9])] * 2
    assert SpanWish.everything().request_for(3) == SpanRequest(full=True)


@pytest.mark.timeout(60)
async def test_the_dashboard_asks_every_span_of_a_small_job_and_the_drawn_and_first_ranks_of_a_large_one() -> None:
    small = DashboardApp(StaticFeed(session_messages(steps=3)), export_on_exit=False)
    async with small.run_test(size=(160, 50)) as pilot:
        await draw_every_message(small, pilot)
        assert small.span_wish() == SpanWish.everything()

    def middling_first_rank(report: StepReport) -> StepReport:  # rank 1 the slowest, rank 0 neither slowest nor fastest
        return replace(report, end=report.end + {0: 0.04, 1: 0.08}.get(report.rank, 0.0))

    large = DashboardApp(StaticFeed(session_messages(steps=6, world_size=80, edit=middling_first_rank)), export_on_exit=False)
    async with large.run_test(size=(160, 50)) as pilot:
        await draw_every_message(large, pilot)
        step = large.session.latest_complete_step()
        assert step is not None
        figures = large.session.step_figures(step)
        slowest = max(figures, key=lambda r: (figures[r].step_ms, -r))
        fastest = min(figures, key=lambda r: (figures[r].step_ms, r))
        assert (slowest, fastest) == (1, 2)
        wish = large.span_wish()
        # every step of the drawn ranks and of the first rank (the advisor's reference); the step on screen from the drawn
        assert wish == SpanWish.sampled(SAMPLE_EVERY_STEPS, {slowest, fastest, 0}, (step,), {slowest, fastest},
                                        LARGE_JOB_DEVICE_EVERY_S)
        assert wish.request_for(5).device_every_s == 1.0  # a device sample a second, not five
        await pilot.press("space")  # paused on a step: every rank's spans of it
        assert large.span_wish().pinned_ranks is None and large.span_wish().pinned_steps == (large.selected_step,)
