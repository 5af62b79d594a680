"""Who meets whom in the all-reduces, as the ranks' hellos say (``Hello.all_reduce_group``)."""

from __future__ import annotations

from ddpwatch.figures.cross_rank import Groups, groups_of_the_world
from ddpwatch.ingest.rank_liveness import RankLiveness
from instrumented_ddp.wire.messages import Hello


class AllReduceGroups:
    """The partition of the world into all-reduce groups the hellos name: HSDP's replicas of one
    shard, a DDP on a subgroup; the ranks no hello names yet one group of their own. None, every
    rank, as for most runs, and where the hellos contradict each other (``problem``:
    ``cross_rank.groups_of_the_world``). Made again only when a hello names another group than
    before, or the world grows."""

    def __init__(self, liveness: RankLiveness) -> None:
        self._liveness = liveness
        self._groups: Groups | None = None
        self._problem: str | None = None  # why the named groups are not used, if they are not
        self._stale = False
        self._world = 0  # the world they were made a partition of

    def hear_hello(self, previous: Hello | None, hello: Hello) -> None:
        """A rank's hello, after ``previous`` (its last, or None): a group named anew makes the
        partition again on the next asking."""
        if previous is None or previous.all_reduce_group != hello.all_reduce_group:
            self._stale = True

    def groups(self) -> Groups | None:
        world = self._liveness.world_size
        if self._stale or self._world != world:
            ranks = self._liveness.ranks.values()
            named = (r.hello.all_reduce_group for r in ranks if r.hello and r.hello.all_reduce_group)
            self._groups, self._problem = groups_of_the_world(named, world)
            self._stale, self._world = False, world
        return self._groups

    @property
    def problem(self) -> str | None:
        """Why the groups the hellos name are not used (they overlap), in one line; else None."""
        self.groups()
        return self._problem
