"""``train.py`` end to end: every strategy under torchrun, accuracy, and wrong input."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from instrumented_ddp.training.data_cache import CACHE_ENV, entry_name
from instrumented_ddp.training.replicas import ranks_that_differ, state_digest
from launch import REPO_ROOT, run_as_torchrun_would

TRAIN = str(REPO_ROOT / "train.py")


def test_a_short_run_learns_the_builtin_reviews_above_chance() -> None:
    """60 steps: the run is seeded, and read 0.416 twice (0.499 at 120 steps, 17 s longer); chance is 0.2.
    Logged at 25, 50 and the last step, 60: that line's rate is over its 10 steps (it read 0.0 samples/s)."""
    result = run_as_torchrun_would([TRAIN, "--strategy", "bucket", "--bucket-mb", "2", "--steps", "60", "--log-every", "25"])
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(result.stdout.split("eval accuracy ")[1].split()[0])
    assert accuracy > 0.3, result.stdout
    assert "on 1000 held-out examples" in result.stdout  # the whole test split unless --eval-examples says less
    rates = {line.split()[1]: float(line.split(" samples/s")[0].split("| ")[-1])
             for line in result.stdout.splitlines() if line.startswith("step ") and "samples/s" in line}
    assert list(rates) == ["25/60", "50/60", "60/60"] and all(rate > 0 for rate in rates.values()), result.stdout
    # the built-in data it trained on is kept for the next run, in the folder the suite gives its processes
    assert (Path(os.environ[CACHE_ENV]) / entry_name(0, 64) / "tokenizer.json").is_file()


def test_a_negative_eval_count_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    from instrumented_ddp.training import train

    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--eval-examples", "-1", "--no-watch"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--eval-examples must be 0 or more")


@pytest.mark.parametrize(
    ("batch_size", "world_size", "grad_accum", "said"),
    [
        (16, 2, 2, None),
        # 16 = 5 x 3 + 1: the multiples of 3 on either side are 15 and 18
        (16, 3, 1, "batch-size 16 does not divide by world size 3 x grad-accum 1: use a multiple of 3 (15 or 18)"),
        # 4 < 3 x 2: no multiple of 6 below it but 0, so only the one above
        (4, 3, 2, "batch-size 4 does not divide by world size 3 x grad-accum 2: use a multiple of 6 (6)"),
        (16, 2, 0, "grad-accum must be at least 1, not 0"),
    ],
)
def test_a_batch_that_does_not_split_names_the_nearest_that_do(batch_size: int, world_size: int, grad_accum: int,
                                                                  said: str | None) -> None:
    from instrumented_ddp.training import train

    assert train.accumulation_problem(batch_size, world_size, grad_accum) == said


def run_train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "zero3"], "invalid choice: 'zero3'"),
        (["--batch-size", "10", "--grad-accum", "3"], "does not divide by world size 1 x grad-accum 3"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--bucket-mb", "-1"], "--bucket-mb must be a positive, finite number of MB, not -1"),
        (["--bucket-mb", "inf"], "--bucket-mb must be a positive, finite number of MB, not inf"),  # was a traceback in wrap
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--lr", "nan"], "--lr must be a finite number, 0 or more, not nan"),
        # a traceback when the profiler wrote its first trace at step 8, or after the last step
        (["--profile", __file__], f"--profile {__file__}: {__file__} is a file, not a directory"),
        (["--save-final", f"{__file__}/final.pt"], f"--save-final {__file__}/final.pt: {__file__} is a file, not a directory"),
        (["--save-final", str(Path(__file__).parent)], "is a directory, not a file"),
    ],
)
def test_wrong_flags_fail_with_one_line_error(args: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process, as ``train.parse_args`` sees them (each ``python train.py`` spends 3-4 s
    importing torch and transformers before it parses); the next test runs one for real."""
    from instrumented_ddp.training import train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_device_cuda_without_cuda_is_a_one_line_error(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a traceback from ``init_distributed`` (CUDA hidden here, so a GPU box says the same)."""
    from instrumented_ddp.training import train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--device", "cuda"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--device cuda: CUDA is not available on this machine (use --device auto or cpu)")


def test_a_wrong_flag_given_to_the_script_exits_2_with_its_one_line_error() -> None:
    """Exactly that line: argparse's usage, 4 lines of it before the reason, printed once per rank
    under torchrun, is left to ``--help``."""
    result = run_train("--batch-size", "16", "--grad-accum", "3")
    assert result.returncode == 2
    assert result.stderr == "train.py: error: --batch-size 16 does not divide by world size 1 x grad-accum 3: use a multiple of 3 (15 or 18)\n"


def test_fsdp_on_a_torch_without_fsdp2_is_a_one_line_error() -> None:
    """FSDP2 hidden, as on a torch before it: the flag is refused before any process group."""
    code = ("import runpy, sys; sys.modules['torch.distributed.fsdp'] = None; "
            "sys.argv = ['train.py', '--strategy', 'fsdp', '--no-watch']; runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("train.py: error: --strategy strategy 'fsdp' needs what torch ")


def refused_switch(strategy: str, bucket_mb: float | None = None, grad_accum: int | None = None,
                   run_bucket_mb: float = 25.0) -> tuple[str, list[tuple[bool, int, str]]]:
    """``train.switch_strategy`` asked to switch a run (at step 7, its cap ``run_bucket_mb``) where
    the command cannot apply: what it says, and the acknowledgements (applied, step, detail) it
    sent; the model and optimizer are checked kept."""
    from types import SimpleNamespace

    from instrumented_ddp.training import train

    acks: list[tuple[bool, int, str]] = []
    # stand-ins with only what switch_strategy reaches of each
    watch: Any = SimpleNamespace(steps=7, acknowledge=lambda command, applied, step, detail="": acks.append((applied, step, detail)))
    model: Any = object()
    optimizer: Any = object()
    args: Any = SimpleNamespace(grad_accum=1, bucket_mb=run_bucket_mb, batch_size=8)
    command: Any = SimpleNamespace(strategy=strategy, grad_accum=grad_accum, bucket_mb=bucket_mb)
    context: Any = SimpleNamespace(world_size=2)
    kept, kept_optimizer, said = train.switch_strategy(model, optimizer, command, args, context, watch)
    assert kept is model and kept_optimizer is optimizer
    return said, acks


def test_a_live_switch_to_fsdp_on_a_torch_without_fsdp2_is_refused_and_the_model_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "instrumented_ddp.strategies.fsdp", None)  # as where FSDP2 cannot be imported
    said, acks = refused_switch("fsdp")
    assert said.startswith("switch to fsdp refused: strategy 'fsdp' needs what torch ")
    assert acks == [(False, 8, said.removeprefix("switch to fsdp refused: "))]


@pytest.mark.parametrize(("bucket_mb", "grad_accum", "said"), [
    (0.0, None, "bucket_mb must be a positive, finite number of MB, not 0"),
    (None, 0, "grad-accum must be at least 1, not 0"),
])
def test_a_live_switch_to_a_cap_or_micro_steps_of_zero_is_refused_not_applied_with_the_old_ones(
        bucket_mb: float | None, grad_accum: int | None, said: str) -> None:
    """Read by falsiness, 0 fell back to the run's own values and the switch was acknowledged as
    applied (a run at 5 MB said *switched to bucket (bucket_mb=5, grad_accum=1)* to a command of 0)."""
    _, acks = refused_switch("bucket", bucket_mb, grad_accum, run_bucket_mb=5.0)
    assert acks == [(False, 8, said)]


def test_a_switch_away_from_fsdp_frees_its_sharded_copy_before_the_next_step(one_rank_group: None) -> None:
    """FSDP2 keeps its sharded copy in torch's own reference cycles: without a collection the copy
    (a model's parameters, gradients and their shards) stayed allocated beside the new strategy."""
    from types import SimpleNamespace

    import instrumented_ddp
    from instrumented_ddp.training import train
    from instrumented_ddp.timing.timeline import NULL_TIMELINE

    wrapped = instrumented_ddp.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)), "fsdp")
    optimizer = wrapped.make_optimizer(torch.optim.AdamW, lr=1e-3)
    wrapped(torch.randn(4, 8)).sum().backward()
    wrapped.finish_gradient_sync()
    optimizer.step()
    sharded = weakref.ref(wrapped.sharded)
    # stand-ins with only what switch_strategy reaches of each
    watch: Any = SimpleNamespace(steps=3, timeline=NULL_TIMELINE, update_hello=lambda **_: None,
                                 acknowledge=lambda *_args, **_kwargs: None)
    args: Any = SimpleNamespace(grad_accum=1, bucket_mb=25.0, batch_size=8, lr=1e-3, strategy="fsdp")
    command: Any = SimpleNamespace(strategy="bucket", grad_accum=None, bucket_mb=None)
    context: Any = SimpleNamespace(world_size=1)
    gc.collect()
    gc.disable()  # a collection in between would free the copy, and the test could not fail
    try:
        wrapped, optimizer, said = train.switch_strategy(wrapped, optimizer, command, args, context, watch)
        assert said.startswith("switched to bucket")
        assert sharded() is not None  # what the collection is for: the cycles hold it so far
        train.free_the_strategy_before(torch.device("cpu"))
        assert sharded() is None
    finally:
        gc.enable()


def test_unknown_model_fails_with_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_train("--model", "no-such-org/no-such-model", "--steps", "1")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: cannot load model 'no-such-org/no-such-model'")


def test_digests_name_the_ranks_that_differ() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    same = state_digest(model)
    with torch.no_grad():
        model.weight[0, 0] += 1e-7
    assert ranks_that_differ([same, same, state_digest(model), same]) == [2]
    assert ranks_that_differ([same, same]) == []
