"""Bytes a rank holds, counted from its tensors: each storage once, and how they are shown and sent."""

from __future__ import annotations

import pytest
import torch

from ddpwatch.wording.figure_text import held_text, kinds_text
from instrumented_ddp.resources.memory import AllocationPeak, MemorySampler, allocation_peak, storage_bytes
from instrumented_ddp.wire.codec import ProtocolError, decode, encode
from instrumented_ddp.wire.messages import StepSummary


def test_views_of_one_buffer_count_it_once_and_empty_or_missing_tensors_nothing() -> None:
    flat = torch.zeros(100)
    views = [flat[:40].view(4, 10), flat[40:]]
    assert storage_bytes([*views, flat, None, torch.empty(0)]) == 400
    assert storage_bytes([torch.zeros(3, dtype=torch.float64), torch.zeros(3)]) == 24 + 12


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_gradient_counts_its_indices_and_values() -> None:
    # a sparse embedding's gradient (DDP supports them): 3 rows of 4 float32 values = 48 bytes,
    # and 3 int64 row indices in a 1 x 3 index tensor = 24; the dense 10 x 4 would be 160
    coo = torch.sparse_coo_tensor(torch.tensor([[1, 4, 7]]), torch.ones(3, 4), (10, 4))
    assert storage_bytes([coo]) == 48 + 24
    # CSR of a 3 x 3 with 2 values: 4 int64 row pointers (32) + 2 int64 columns (16) + 2 floats (8)
    csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 2]), torch.ones(2), (3, 3))
    assert storage_bytes([csr]) == 32 + 16 + 8


def test_sampler_measures_a_strategys_second_step_then_every_tenth() -> None:
    class Strategy:  # what held_memory reads
        def __init__(self) -> None:
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.optimizers = ()

        def held_parameters(self) -> list[torch.Tensor]:
            return [self.weight]

        def optimized_parameters(self) -> list[torch.Tensor]:
            return [self.weight]

    sampler, first, second = MemorySampler(every=10), Strategy(), Strategy()
    measured = [step for step in range(1, 25) if sampler.sample(first) is not None]
    assert measured == [2, 12, 22]
    assert sampler.sample(second) is None  # a switch starts the count again
    held = sampler.sample(second)
    assert held is not None and held["peak"] > 0  # the resident set, on a CPU
    assert (held["parameters"], held["gradients"], held["optimizer_state"]) == (32, 0, 0)


def test_texts_read_the_staircase_and_the_other_collectives() -> None:
    mib = 2**20
    assert held_text({"parameters": 10 * mib, "gradients": 5 * mib, "optimizer_state": 2 * mib // 2, "peak": 1}) == "10.0/5.0/1.0"
    assert held_text({}) == "—"
    # 16,404 bytes = 0.01564 MiB (a 4,101-parameter model's float32 weights) read 0.0; 0 bytes is 0.0
    assert held_text({"parameters": 16_404, "gradients": 0, "optimizer_state": 32_824}) == "0.016/0.0/0.031"
    assert held_text({"parameters": 32, "gradients": 0, "optimizer_state": 0}) == "<0.001/0.0/0.0"  # 32 bytes
    assert kinds_text({"all_reduce": 3.0, "reduce_scatter": 2.0, "all_gather": 4.5}) == "AG 4.5 RS 2"
    assert kinds_text({"all_reduce": 3.0}) == "—"


def summary(**extra: object) -> dict:
    return {"rank": 0, "step": 1, "strategy": "zero2", "settings": {}, "start": 0.0, "end": 1.0, "samples": 1,
            "tokens": 1, "compute_pct": 50.0, "non_compute_pct": 10.0, "idle_pct": 40.0, "overlap_pct": 0.0,
            "comm_overhead_pct": 10.0, "anchor": None, "busbw_gbps": None, "all_reduce_tags": [],
            "all_reduce_seconds": b"", "algbw_gbps": b"", **extra}


def test_summaries_carry_calls_by_kind_and_memory_and_refuse_unknown_names() -> None:
    good = StepSummary(**summary(calls_by_kind={"reduce_scatter": 3}, memory={"parameters": 10, "peak": 99}))
    assert decode(encode(good, seq=0)).message == good
    for bad in ({"calls_by_kind": {"send_recv": 1}}, {"memory": {"parameters": -1}}, {"memory": {"weights": 5}},
                {"calls_by_kind": {"all_gather": 1.5}}):
        with pytest.raises(ProtocolError, match="unknown name or a bad count"):
            decode(encode(StepSummary(**summary(**bad)), seq=0))



def test_allocation_peak_is_the_highest_rise_above_the_start_with_what_was_alive_then() -> None:
    """Records out of time order, as the profiler's tree gives them; by hand, in time order:
    t=1 +100 at A (rise 100), t=2 +50 at B (150), t=3 -100 frees A (50), t=4 +80 at C (130),
    t=5 -300 frees D, held before the run began (-170), t=6 +200 at E (30): the peak is 150 at
    t=2, A and B alive; C and E, allocated later, never count; freeing what the run did not
    allocate lowers the rise and removes nothing."""
    records = [(4, 80, 0xC), (1, 100, 0xA), (3, -100, 0xA), (2, 50, 0xB), (6, 200, 0xE), (5, -300, 0xD)]
    assert allocation_peak(records) == AllocationPeak(rise=150, at=2, alive={0xA: 100, 0xB: 50})
    assert allocation_peak([]) == AllocationPeak()  # nothing allocated: no rise
    assert allocation_peak([(1, -64, 0xF)]) == AllocationPeak()  # only frees: the rise never passes 0


def test_a_rank_whose_memory_cannot_be_measured_says_so_once_and_trains_on(capsys: pytest.CaptureFixture[str]) -> None:
    class Unmeasurable:  # a tensor kind held_memory cannot count yet
        optimizers: tuple[torch.optim.Optimizer, ...] = ()

        def held_parameters(self) -> list[torch.Tensor]:
            raise NotImplementedError("Cannot access storage of SomeTensorImpl")

    sampler = MemorySampler(every=1)
    assert [sampler.sample(Unmeasurable()) for _ in range(3)] == [None, None, None]
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["ddpwatch: the memory this rank holds cannot be measured (NotImplementedError: Cannot access "
                     "storage of SomeTensorImpl): its memory columns stay empty; training goes on"]
