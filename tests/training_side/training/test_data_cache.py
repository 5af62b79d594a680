"""The built-in data kept on disk between runs: read back as built, named by all it is made from,
rebuilt when damaged, and only slower, never failing, where it cannot be kept."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from instrumented_ddp.training import data
from instrumented_ddp.training import data_cache
from instrumented_ddp.training.data_cache import CACHE_ENV, builtin_reviews_tokenized, cache_folder, entry_name

Built = tuple[datasets.DatasetDict, PreTrainedTokenizerFast]


@pytest.fixture(scope="module")
def built() -> Built:
    """The default run's data (seed 0, 64 tokens), built without a cache."""
    tokenized, tokenizer, problem = builtin_reviews_tokenized(0, 64, None)
    assert problem is None
    return tokenized, tokenizer


def assert_same(a: Built, b: Built) -> None:
    (tokenized_a, tokenizer_a), (tokenized_b, tokenizer_b) = a, b
    assert tokenizer_a.get_vocab() == tokenizer_b.get_vocab() and tokenizer_a.pad_token_id == tokenizer_b.pad_token_id == 0
    for split in ("train", "test"):
        rows_a, rows_b = tokenized_a[split][:], tokenized_b[split][:]
        assert sorted(rows_a) == sorted(rows_b) == ["attention_mask", "input_ids", "labels"]
        for column in rows_a:
            assert isinstance(rows_b[column], torch.Tensor) and torch.equal(rows_a[column], rows_b[column]), (split, column)


def test_the_first_call_keeps_the_data_and_the_next_reads_back_what_was_built(tmp_path: Path, built: Built) -> None:
    first = builtin_reviews_tokenized(0, 64, tmp_path)
    assert first[2] is None
    (entry,) = tmp_path.iterdir()  # nothing half-written left beside it
    assert entry.name == entry_name(0, 64)
    again = builtin_reviews_tokenized(0, 64, tmp_path)
    assert again[2] is None
    assert_same(first[:2], built)
    assert_same(again[:2], built)
    assert again[0]["train"].cache_files  # read from the entry's files, not built again in memory


def test_an_entry_is_named_by_the_seed_the_length_and_the_datas_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    names = {entry_name(0, 64), entry_name(1, 64), entry_name(0, 32)}
    assert len(names) == 3 and all(name.startswith("builtin-reviews-") for name in names)
    assert entry_name(0, 64) == entry_name(0, 64)
    edited = tmp_path / "data.py"
    edited.write_text(Path(data.__file__).read_text() + "\n# an edit\n")
    monkeypatch.setattr(data, "__file__", str(edited))
    assert entry_name(0, 64) not in names


def test_the_folder_is_the_variables_or_the_users_cache_and_off_turns_it_off(tmp_path: Path) -> None:
    home = str(Path("~").expanduser())
    assert cache_folder({}) == Path(home) / ".cache" / "ddpwatch"
    assert cache_folder({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "ddpwatch"
    assert cache_folder({CACHE_ENV: str(tmp_path / "mine"), "XDG_CACHE_HOME": "/elsewhere"}) == tmp_path / "mine"
    for off in ("off", "OFF", "0", "", "none"):
        assert cache_folder({CACHE_ENV: off}) is None, off


def test_a_damaged_entry_is_said_built_again_and_replaced(tmp_path: Path, built: Built) -> None:
    builtin_reviews_tokenized(0, 64, tmp_path)
    entry = tmp_path / entry_name(0, 64)
    (entry / "tokenizer.json").write_text("{not json")
    tokenized, tokenizer, problem = builtin_reviews_tokenized(0, 64, tmp_path)
    assert problem is not None and problem.startswith(f"the kept built-in data in {entry} could not be read (")
    assert problem.endswith("): built again") and "\n" not in problem
    assert_same((tokenized, tokenizer), built)
    assert builtin_reviews_tokenized(0, 64, tmp_path)[2] is None  # the replaced entry reads back
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]


def test_a_folder_that_cannot_be_written_still_gives_the_data_and_says_why_in_one_line(tmp_path: Path, built: Built) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    tokenized, tokenizer, problem = builtin_reviews_tokenized(0, 64, blocked / "cache")
    assert_same((tokenized, tokenizer), built)
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"cannot keep the built-in data in {blocked / 'cache'} (")
    assert problem.endswith(f"it is built afresh each run; set {CACHE_ENV} to a writable folder, or to off")


def test_a_rank_that_renames_its_entry_in_second_keeps_the_first_and_leaves_nothing_behind(tmp_path: Path, built: Built) -> None:
    """Ranks started together each build and rename; the rename that finds an entry in place yields to it."""
    entry = tmp_path / entry_name(0, 64)
    data_cache._save(entry, *built, replace=False)
    first = sorted(p.name for p in entry.rglob("*"))
    data_cache._save(entry, *built, replace=False)
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]
    assert sorted(p.name for p in entry.rglob("*")) == first
    assert builtin_reviews_tokenized(0, 64, tmp_path)[2] is None
