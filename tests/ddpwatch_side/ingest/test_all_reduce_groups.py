"""Who meets whom in the all-reduces, as the hellos say (``ddpwatch.ingest.all_reduce_groups``)."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.ingest.all_reduce_groups import AllReduceGroups
from ddpwatch.ingest.rank_liveness import RankLiveness
from synthetic_session import hello


def said_hello(liveness: RankLiveness, groups: AllReduceGroups, rank: int, group: list[int], world: int = 4) -> None:
    state = liveness.ranks[rank]
    message = replace(hello(rank, world_size=world), all_reduce_group=group)
    groups.hear_hello(state.hello, message)
    liveness.note_hello(state, message)


def test_hellos_naming_no_group_leave_every_rank_in_one() -> None:
    liveness = RankLiveness()
    groups = AllReduceGroups(liveness)
    for rank in range(4):
        said_hello(liveness, groups, rank, [])
    assert groups.groups() is None and groups.problem is None


def test_replica_groups_partition_the_world_the_unnamed_ranks_a_group_of_their_own() -> None:
    liveness = RankLiveness()
    groups = AllReduceGroups(liveness)
    said_hello(liveness, groups, 0, [0, 2])
    said_hello(liveness, groups, 2, [0, 2])
    assert groups.groups() == [[0, 2], [1, 3]]  # ranks 1 and 3 not heard of yet
    said_hello(liveness, groups, 1, [1, 3])
    said_hello(liveness, groups, 3, [1, 3])
    assert groups.groups() == [[0, 2], [1, 3]] and groups.problem is None


def test_overlapping_groups_fall_back_to_the_world_and_say_why() -> None:
    liveness = RankLiveness()
    groups = AllReduceGroups(liveness)
    said_hello(liveness, groups, 0, [0, 1])
    said_hello(liveness, groups, 2, [1, 2])
    assert groups.groups() is None
    assert groups.problem is not None and "rank 1 in {0, 1} and {1, 2}" in groups.problem


def test_the_partition_is_made_again_when_the_world_grows_or_a_hello_names_another_group() -> None:
    liveness = RankLiveness()
    groups = AllReduceGroups(liveness)
    said_hello(liveness, groups, 0, [0, 1], world=2)
    said_hello(liveness, groups, 1, [0, 1], world=2)
    assert groups.groups() == [[0, 1]]
    said_hello(liveness, groups, 1, [0, 1], world=4)  # the same group, in a world of 4
    assert groups.groups() == [[0, 1], [2, 3]]
    said_hello(liveness, groups, 0, [0, 2], world=4)
    assert groups.groups() is None and groups.problem is not None  # {0, 1} and {0, 2} share rank 0
