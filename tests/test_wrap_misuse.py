"""``instrumented_ddp.wrap`` refuses what no strategy can run, in one line, before its broadcast."""

from __future__ import annotations

import pytest
import torch

import instrumented_ddp
from instrumented_ddp.protocol import bucket_mb_problem


def test_an_unknown_strategy_is_named_with_the_ones_there_are(one_rank_group: None) -> None:
    with pytest.raises(ValueError, match=r"^unknown strategy 'zero3'; choose one of simple, ga, .*, fsdp$"):
        instrumented_ddp.wrap(torch.nn.Linear(4, 2), "zero3")


@pytest.mark.parametrize("strategy", ["bucket", "ddp", "zero1"])
@pytest.mark.parametrize(("bucket_mb", "said"), [(float("inf"), "not inf"), (0, "not 0"), (-1.5, "not -1.5"),
                                                  (float("nan"), "not nan"), ("25", "number of MB, not '25'")])
def test_a_cap_that_is_not_a_positive_finite_number_of_mb_is_refused(one_rank_group: None, strategy: str,
                                                                     bucket_mb: object, said: str) -> None:
    """An infinite cap passed as positive and then broke the int() of bytes inside the strategy
    (and inside DDP): a traceback on every rank, where now it is one line."""
    with pytest.raises(ValueError, match=rf"^bucket_mb must be a .*{said}$"):
        instrumented_ddp.wrap(torch.nn.Linear(4, 2), strategy, bucket_mb=bucket_mb)


def test_the_smallest_and_largest_sane_caps_pass() -> None:
    assert bucket_mb_problem(1e-6) is None and bucket_mb_problem(2048) is None and bucket_mb_problem(25) is None
    assert bucket_mb_problem(True) == "bucket_mb must be a number of MB, not True"
