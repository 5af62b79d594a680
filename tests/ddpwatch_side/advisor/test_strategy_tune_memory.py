"""``tune --strategies``' measured memory where the segment's figures have none: the ranks'
newest measured reports within the segment's steps (``strategy_tune.measured_in``)."""

from __future__ import annotations

from ddpwatch.advisor.strategy_tune import measured_in
from ddpwatch.ingest.rank_state import RankState
from ddpwatch.ingest.segments import Segment
from ddpwatch.ingest.session import Session


def test_the_most_any_rank_held_in_the_segments_steps_and_none_from_before_it() -> None:
    session = Session()
    session.ranks[0] = RankState(memory={"parameters": 100, "gradients": 40, "peak": 300}, memory_step=12)
    session.ranks[1] = RankState(memory={"parameters": 100, "gradients": 60, "peak": 250}, memory_step=13)
    session.ranks[2] = RankState(memory={"parameters": 900}, memory_step=9)  # before the switch: not this strategy's
    segment = Segment(index=1, strategy="zero2", settings={}, first_step=11, last_step=15)
    assert measured_in(session, segment) == {"parameters": 100, "gradients": 60, "peak": 300}
    assert measured_in(session, Segment(index=2, strategy="ddp", settings={}, first_step=16, last_step=20)) == {}
