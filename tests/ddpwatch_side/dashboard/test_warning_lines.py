"""``ddpwatch.dashboard.views.warning_lines``: what the warnings panel says, pure functions of the session."""

from __future__ import annotations

from ddpwatch.dashboard.views.warning_lines import rejected_lines


def test_messages_of_another_ddpwatch_are_said_apart_from_malformed_ones() -> None:
    """A rank on a newer ddpwatch sends message types this one does not know: *malformed* sent the
    user looking for a broken network or sender, where the fix is one ddpwatch version."""
    lines = rejected_lines({"unknown_type": 12, "wrong_version": 2, "garbage": 3, "truncated": 1})
    assert lines == [
        "12 message(s) of a type, or holding a span of a kind, this ddpwatch does not know, left out: the ranks run "
        "a newer ddpwatch than this dashboard (the session file keeps them; upgrade ddpwatch here to see them)",
        "2 message(s) in another version of ddpwatch's wire format than this dashboard's (1), left out: run the same "
        "ddpwatch version on the ranks and here",
        "rejected 4 malformed message(s): 3 garbage, 1 truncated",
    ]
    assert rejected_lines({"invalid": 1}) == ["rejected 1 malformed message(s): 1 invalid"]
    assert rejected_lines({}) == [] and rejected_lines({"garbage": 0}) == []
