"""``instrumented_ddp.wrap`` refuses what no strategy can run, in one line, before its broadcast."""

from __future__ import annotations

import pytest
import torch

import instrumented_ddp
from instrumented_ddp.wire.messages import bucket_mb_problem


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
    # DDP's reducer takes the bytes as a 64-bit integer: 1e13 MB passed, then a TypeError on every rank
    assert bucket_mb_problem(1e9) is None
    assert bucket_mb_problem(1e13) == "bucket_mb must be at most 1e+09 MB (a petabyte), not 1e+13"


def test_the_bucket_strategys_layout_indexes_the_trainable_parameters_as_the_hello_lists_them(one_rank_group: None) -> None:
    """A frozen parameter between trainable ones: indexed among all of them, every index after
    it was one too high, and the advisor read the wrong sizes or raised IndexError."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[1].weight.requires_grad_(False)
    wrapped = instrumented_ddp.wrap(model, "bucket", bucket_mb=1e-4)
    listed = [name for name, p in model.named_parameters() if p.requires_grad]  # the hello's parameter_layout
    indices = sorted(i for bucket in wrapped.bucket_layout for i in bucket)
    assert indices == list(range(len(listed)))
