"""What a torch ``DistributedDataParallel`` gets when it is watched.

Shared by the ``ddp`` strategy, which builds its own DDP, and by ``attach``, which watches the
one a user built: every bucket's all-reduce is timed, seen through a communication hook that
does what DDP's default does or, for the ``ddp`` strategy on the CPU, through the
``ForwardingGroup`` DDP was built on (DDP's own reduction, no hook), or, where the user's DDP has a
hook of its own (gradient compression), as that hook issues them (``hooked_collectives``); DDP's
per-forward buffer broadcast is timed; and the time from the last bucket's launch to the end of
backward is a blocking ``wait``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from instrumented_ddp.timing import hooked_collectives
from instrumented_ddp.timing.bucket_completion import BucketCompletion, launched_by_a_gradient
from instrumented_ddp.timing.bucket_layout import BucketLayout
from instrumented_ddp.timing.buffer_broadcast import timed_buffer_broadcast
from instrumented_ddp.timing.collectives import timed_all_reduce_result
from instrumented_ddp.timing.forwarding_group import ForwardingGroup
from instrumented_ddp.timing.timeline import NULL_TIMELINE, NullTimeline, StepTimeline
from instrumented_ddp.timing.users_hook_timing import UsersHookTiming

#: On the CPU, about this many gradient hooks look at the running buckets in each backward
#: (``parameters_to_look_from``).
LOOKS_PER_BACKWARD = 256


class DDPTiming:
    """The timed bucket all-reduces and buffer broadcast of one ``DistributedDataParallel``.

    DDP waits for its last buckets inside ``backward()`` itself. It launches a bucket as soon as
    the bucket's last gradient is ready, so the last launch is where backward's compute ended;
    from there to the end of backward is recorded as a blocking ``wait`` (blocked is not busy)
    when ``backward_ended`` is called. A model with buffers has them broadcast from rank 0 at the
    start of every forward (``broadcast_buffers=True``, DDP's default): that broadcast is a
    blocking ``broadcast`` span tagged ``buffers`` inside forward, not forward compute.

    A DDP built on a ``ForwardingGroup`` gets no hook: the group hands each bucket's all-reduce
    to ``_launch_watched_bucket``, which marks it ready, issues it on gloo's group, timed, and
    returns gloo's work for DDP to wait for itself. Otherwise a hook does it (``attach``: a
    user's DDP keeps the group it was built with; NCCL, which averages inside the all-reduce).

    On the CPU no Python runs on gloo's threads (see ``clocks.HostClock`` for why):
    a hook's future is the usual ``.then`` on the work's future, whose callback needs the GIL on
    gloo's thread, so there the hook hands DDP a future of its own instead, and completes it
    from an end-of-backward callback queued before DDP's (``BucketCompletion``). DDP's reducer
    waits for its buckets' futures only there, at the end of backward
    (``Reducer::finalize_backward``, queued once the last bucket is launched), so waiting for
    the works one callback earlier changes nothing it sees, and a failed collective still
    reaches DDP, as the exception of its future. Static graph's first iteration is the one
    exception: it launches every bucket from an end-of-backward callback and finalizes in that
    same call, so there the hook hands DDP the ``.then`` future (that iteration is excluded).

    A DDP that already has a communication hook of the user's (``users_hook``: fp16 or PowerSGD
    compression) keeps it, since DDP takes one: what that hook issues is timed as it is issued
    (``UsersHookTiming``). Its buckets are not marked ready, so the advisor, which replays DDP's
    own all-reduce of each bucket, has nothing to replay.
    """

    def __init__(self, ddp: DistributedDataParallel, timeline: StepTimeline | NullTimeline) -> None:
        #: Held weakly: DDP's C++ reducer holds the hook (and a ``ForwardingGroup`` its watcher),
        #: which hold this; a strong reference back would make a cycle through C++ that Python's
        #: collector cannot see, and a watched DDP, its bucket copies of every gradient and its
        #: model would never be freed, detached or not.
        self._ddp = weakref.ref(ddp)
        self.timeline = timeline
        self.process_group: dist.ProcessGroup | None = getattr(ddp, "process_group", None)
        self.world_size = dist.get_world_size(self.process_group)
        self.last_bucket_at: Any = None  # the stamp of this backward's last bucket launch, if any
        #: Whether DDP's gradients are views of its buckets by now (``gradient_as_bucket_view``,
        #: after the first backward that reduced): DDP's default then divides in place.
        self.gradients_are_views = False
        self.reduced_backwards = 0  # backwards that reduced gradients (not under ``no_sync``)
        self._bucket_layout = BucketLayout(lambda: self.ddp)
        #: On the CPU, this backward's launched buckets, completed at its end.
        self._completion = BucketCompletion(lambda: self.timeline)
        #: Buckets launched in this backward (the ``ForwardingGroup``'s ``b<i>``), counted until
        #: ``backward_ended``: a completion can run at a nested backward's end, mid-step.
        self._launched = 0
        self._poll_handles: list[Any] = []  # on the CPU, gradient hooks that look: ``install``
        #: The user's own communication hook, by name, where they registered one (None: ours).
        self.users_hook = users_comm_hook(ddp)
        self._hooked = UsersHookTiming(self, ddp, self._completion) if self.users_hook is not None else None

    @property
    def ddp(self) -> DistributedDataParallel:
        ddp = self._ddp()
        if ddp is None:  # whoever calls this (attach, the ddp strategy) holds the DDP; its hooks never ask
            raise RuntimeError("DDPTiming: its DistributedDataParallel was freed")
        return ddp

    def install(self) -> None:
        """Register the hook (DDP takes one, and keeps it for good) and time the buffer broadcast.

        On the CPU some parameters also get a gradient hook that only looks at the running
        buckets (``HostClock``): otherwise a bucket that completes in backward is seen at the
        next bucket's launch only, late by a large part of its all-reduce. A Python hook on every
        parameter costs step time, so the looks are spread by gradient elements instead
        (``parameters_to_look_from``)."""
        if not isinstance(self.process_group, ForwardingGroup) and self.users_hook is None:
            ddp = self.ddp
            ddp.register_comm_hook(state=None, hook=self._all_reduce_hook())
            # Deliberately put over DDP's bound methods, on this instance only: DDP takes one hook.
            ddp.register_comm_hook = ddp._register_builtin_comm_hook = refuse_a_second_hook  # type: ignore[method-assign]
        self.resume(self.timeline)

    def resume(self, timeline: StepTimeline | NullTimeline) -> None:
        """Time the buckets on ``timeline``: at ``install``, and again after ``stop_timing`` for a
        second ``attach`` of the same DDP (a Trainer's second ``train()``), whose hook it kept."""
        self.timeline = timeline
        if isinstance(self.process_group, ForwardingGroup):
            self.process_group.watcher = self._launch_watched_bucket
        if self._hooked is not None:
            self._hooked.resume()
        # Deliberately put over DDP's bound method, on this instance only (``stop_timing`` pops it).
        self.ddp._distributed_broadcast_coalesced = timed_buffer_broadcast(  # type: ignore[method-assign]
            self.ddp._distributed_broadcast_coalesced, lambda: self.timeline)
        if self.timeline.polls:
            poll = self.timeline.poll
            trainable = [parameter for parameter in self.ddp.module.parameters() if parameter.requires_grad]
            self._poll_handles = [parameter.register_post_accumulate_grad_hook(lambda _gradient: poll())
                                  for parameter in parameters_to_look_from(trainable, LOOKS_PER_BACKWARD)]

    def stop_timing(self) -> None:
        """DDP cannot drop a communication hook: the hook stays and averages as DDP does, untimed
        (a ``ForwardingGroup`` just forwards)."""
        if isinstance(self.process_group, ForwardingGroup):
            self.process_group.watcher = None
        if self._hooked is not None:
            self._hooked.stop()
        for handle in self._poll_handles:
            handle.remove()
        self._poll_handles = []
        self.timeline = NULL_TIMELINE
        self.last_bucket_at = None
        self.ddp.__dict__.pop("_distributed_broadcast_coalesced", None)  # the class's own method again

    def bucket_layout(self) -> list[list[int]]:
        """DDP's buckets once it has rebuilt them in gradient-ready order (its logging data says so
        a few iterations in): the parameter indices of each, bucket ``b<i>`` the i-th; [] before.
        Kept once found, and looked for in the first ``BUCKET_LAYOUT_STEPS`` reducing backwards
        only (``BucketLayout``)."""
        return self._bucket_layout.find(self.reduced_backwards)

    @property
    def on_first_buckets(self) -> bool:
        """Whether DDP's next reducing backward still uses the buckets it starts with, before it
        rebuilds them in the order gradients became ready (one bucket of every gradient, unless it
        looks for unused parameters): its first reducing backward, and its first two under
        ``static_graph``, whose first reduces every bucket at the end of backward and whose second
        reads the order. Asked as a step begins: a step that begins on them is DDP's first
        iteration, however many of its backwards reduce (a loop accumulating gradients without
        ``no_sync`` reduces in each, so asked as the step ends, its first step would read as
        past them)."""
        return self.reduced_backwards < (2 if getattr(self.ddp, "static_graph", False) else 1)

    def backward_began(self) -> None:
        """Called from inside the step's backward as it begins (``attach``: the first gradient
        reaching the forward's output), so that buckets launched in a backward nested in it
        (reentrant checkpointing) are told apart: see ``BucketCompletion.wait_at_backward_end``.
        With a hook of the user's, its all-reduces on this thread are timed from now (``UsersHookTiming``)."""
        self._completion.backward_began()
        self.last_bucket_at = None  # a backward that raised never ended: its last bucket is not this one's
        if self._hooked is not None:
            self._hooked.backward_began(bool(getattr(self.ddp, "require_backward_grad_sync", True)))

    def backward_ended(self) -> bool:
        """Called when backward has ended (DDP's in-backward wait ends about now). Records the
        wait after the last bucket; True when this backward reduced gradients (not ``no_sync``)."""
        self._completion.backward_ended()
        self._launched = 0
        reduced = self.last_bucket_at is not None
        if self._hooked is not None:  # reduced unless under no_sync, whether its collectives were seen or not
            reduced = self._hooked.backward_ended() or reduced
        if self.last_bucket_at is not None:
            timeline = self.timeline
            assert not isinstance(timeline, NullTimeline), "a bucket's launch is stamped only while timing"
            timeline.add_span("wait", self.last_bucket_at, timeline.stamp(), blocking=True)
            self.last_bucket_at = None
        if reduced:
            self.gradients_are_views = bool(getattr(self.ddp, "gradient_as_bucket_view", False))
            self.reduced_backwards += 1
        return reduced

    def _all_reduce_hook(self) -> Callable[..., torch.futures.Future]:
        """DDP checks a hook's annotations against real types, which postponed (string)
        annotations are not; hence an unannotated closure.

        DDP's C++ default multiplies each gradient by 1/world size while it copies it into its
        bucket (one pass) and sums; where the gradient already is a view of the bucket
        (``gradient_as_bucket_view=True``, after the first backward) it divides the bucket in
        place instead. A hook gets the bucket already filled: scaling it then is a second pass
        over every gradient, the same result bit for bit when it multiplies or divides as DDP
        would have (1/3 and /3 round differently). A run in view mode that sets gradients to
        None every step (``zero_grad()``'s default) makes DDP copy again, which the hook cannot
        see: there the last bit may differ at a world size that is not a power of two. NCCL
        averages inside the all-reduce (``ReduceOp.AVG``: NCCL's pre-multiplied sum by 1/n for
        floating types), so there the hook makes no extra pass. Gloo takes ``ReduceOp.AVG`` too,
        but runs it as a sum and then a division pass over the result on its worker thread
        (``ProcessGroupGlooDetail.hpp``): the same second pass, slower than the multiply, and
        rounding as a divide does; so on gloo the hook scales first, as DDP's own Python default
        hook does."""
        averaging = averaging_op(self.process_group)
        scale = 1.0 / self.world_size

        # Unannotated on purpose: DDP reads a hook's annotations and refuses any that is not its own
        # class (this module's are strings: ``bucket annotation should be dist.GradBucket``).
        def timed_all_reduce(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            timeline = self.timeline
            buffer = bucket.buffer()
            if not isinstance(timeline, NullTimeline):  # DDP calls the hook in bucket order, once a bucket is ready
                self.last_bucket_at = timeline.stamp()
                timeline.mark_ready(f"b{bucket.index()}", buffer.numel() * buffer.element_size(), at=self.last_bucket_at)
            if averaging is None and self.gradients_are_views:
                buffer.div_(self.world_size)
            elif averaging is None:
                buffer.mul_(scale)
            op = averaging or dist.ReduceOp.SUM
            issued_at = self.last_bucket_at if averaging is not None else None  # after a scaling pass: stamped again
            if not isinstance(timeline, NullTimeline) and timeline.polls and self.process_group is not None:
                return self._all_reduce_to_backward_end(timeline, self.process_group, buffer, bucket.index(), op,
                                                        issued_at)
            return timed_all_reduce_result(timeline, buffer, tag=f"b{bucket.index()}", group=self.process_group, op=op,
                                           at=issued_at)

        return timed_all_reduce

    def _all_reduce_to_backward_end(self, timeline: StepTimeline, group: dist.ProcessGroup,
                                    buffer: torch.Tensor, index: int, op: dist.ReduceOp.RedOpType,
                                    issued_at: Any) -> torch.futures.Future:
        """The bucket's all-reduce, and a future of ``buffer`` that ``BucketCompletion`` completes
        at the end of this backward, before DDP reads it; ``.then`` on the work where DDP would
        wait for it before that callback ran (static graph's first iteration:
        ``launched_by_a_gradient``) or where none can be queued (not inside a backward).

        Issued on DDP's process group itself, as DDP's reducer does, not through
        ``dist.all_reduce``: its Python checks (subgroups, tensor subclasses, complex numbers,
        coalescing) are for a user's tensors, not a DDP bucket, and on the CPU they are a large
        part of the hook's cost."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(op)  # what assigning ``op`` converts it to implicitly
        work = self._issue_bucket(timeline, group, [buffer], buffer.numel() * buffer.element_size(), options, index,
                                  issued_at)
        future: torch.futures.Future = torch.futures.Future()
        if launched_by_a_gradient() and self._completion.wait_at_backward_end(work, buffer, future):
            return future
        return work.get_future().then(lambda done: done.value()[0])

    def _launch_watched_bucket(self, group: dist.ProcessGroup, tensors: list[torch.Tensor],
                               options: dist.AllreduceOptions) -> dist.Work:
        """The ``ForwardingGroup``'s all-reduce: DDP's reducer launching a bucket (one flat
        tensor, already scaled by 1/world size as DDP copied the gradients in), in bucket order,
        as soon as its last gradient is ready. ``b<i>`` is the i-th launched in this backward.
        DDP waits for the work itself at the end of backward; ``BucketCompletion`` waits for it
        one callback earlier, looking around the wait, and leaves a failure to DDP's own wait."""
        timeline = self.timeline
        assert not isinstance(timeline, NullTimeline), "the watcher is set only while timing (``resume`` to ``stop_timing``)"
        index = self._launched
        self._launched += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.last_bucket_at = timeline.stamp()
        timeline.mark_ready(f"b{index}", nbytes, at=self.last_bucket_at)
        work = self._issue_bucket(timeline, group, tensors, nbytes, options, index, self.last_bucket_at)
        self._completion.wait_at_backward_end(work, tensors[0], None)
        return work

    @staticmethod
    def _issue_bucket(timeline: StepTimeline, group: dist.ProcessGroup, tensors: list[torch.Tensor], nbytes: int,
                      options: dist.AllreduceOptions, index: int, issued_at: Any) -> dist.Work:
        """Bucket ``b<index>``'s all-reduce of ``nbytes`` on ``group``, as a non-blocking span
        starting at ``issued_at``, the stamp that marked the bucket ready a moment before (None
        where a pass over the bucket came between: stamped now)."""
        span = timeline.open_collective("all_reduce", nbytes, f"b{index}", str(tensors[0].dtype).removeprefix("torch."), False,
                                        at=issued_at)
        work = group.allreduce(tensors, options)
        timeline.close_collective(span, work)
        return work


def refuse_a_second_hook(*_args: Any, **_kwargs: Any) -> None:
    """A DDP's ``register_comm_hook`` once ddpwatch's hook is in: DDP would refuse a second hook
    too, saying only that it *can only be called once*, to a user who called it once."""
    raise RuntimeError("DistributedDataParallel.register_comm_hook after instrumented_ddp.attach: DDP takes one "
                       "communication hook, and attach gave it ddpwatch's timing hook; register yours before attach, "
                       "which then times the all-reduces your hook issues")


def users_comm_hook(ddp: DistributedDataParallel) -> str | None:
    """The name of the Python communication hook a user registered on ``ddp`` (``_comm_hooks``
    holds it with its state), or None; ddpwatch's own, from an earlier ``attach`` of the same
    DDP, is not one (that ``DDPTiming`` is kept on the model, and knows its ``users_hook``)."""
    kept = getattr(ddp, "_ddpwatch_timing", None)
    if kept is not None:
        return kept.users_hook
    return hooked_collectives.hook_name(ddp._comm_hooks[0][0]) if ddp._comm_hooks else None


def averaging_op(process_group: dist.ProcessGroup | None) -> dist.ReduceOp.RedOpType | None:
    """``ReduceOp.AVG`` where the group's backend averages inside the all-reduce (NCCL), else
    None: the caller scales and sums (gloo's AVG is a sum, then a division: see the hook)."""
    return dist.ReduceOp.AVG if dist.get_backend(process_group) == "nccl" else None


def parameters_to_look_from(parameters: list[torch.nn.Parameter], looks: int) -> list[torch.nn.Parameter]:
    """The parameters whose gradient hooks look at the running buckets: one each time another
    1/``looks`` of the model's gradient elements has been produced, walking the parameters
    last to first (roughly the order backward produces them in). Backward's time goes with
    elements, not with parameter count, so the looks come about evenly through it, and there
    are at most ``looks`` of them whatever the model (in a transformer, its weight matrices, not
    its norms)."""
    every = sum(parameter.numel() for parameter in parameters) / looks
    chosen: list[torch.nn.Parameter] = []
    since_last_look = 0
    for parameter in reversed(parameters):
        since_last_look += parameter.numel()
        if since_last_look >= every:
            chosen.append(parameter)
            since_last_look = 0
    return chosen
