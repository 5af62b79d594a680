"""Pins the data pipeline's contract: offline, deterministic, rank-sharded, learnable."""

from __future__ import annotations

import random
from collections import Counter

import datasets
import huggingface_hub.constants
import pytest
import torch

from instrumented_ddp.training.data import (
    DataUnavailableError,
    build_tokenizer,
    load_reviews,
    make_builtin_reviews,
    make_loaders,
    tokenize_reviews,
)

MAX_LEN = 64


@pytest.fixture(scope="module")
def reviews() -> datasets.DatasetDict:
    return make_builtin_reviews()  # the default size the training script uses


@pytest.fixture(scope="module")
def tokenizer(reviews):
    return build_tokenizer(reviews["train"]["text"])


@pytest.fixture(scope="module")
def tokenized(reviews, tokenizer) -> datasets.DatasetDict:
    return tokenize_reviews(reviews, tokenizer, max_length=MAX_LEN)


def _rows(ds: datasets.Dataset) -> list[tuple[str, int]]:
    return list(zip(ds["text"], ds["label"], strict=True))


def test_generation_is_deterministic_and_ignores_global_rng():
    random.seed(1)
    torch.manual_seed(1)
    a = make_builtin_reviews(n_train=300, n_test=100, seed=7)
    random.seed(2)
    torch.manual_seed(2)
    b = make_builtin_reviews(n_train=300, n_test=100, seed=7)
    for split in ("train", "test"):
        assert _rows(a[split]) == _rows(b[split])


def test_test_split_does_not_depend_on_train_size():
    a = make_builtin_reviews(n_train=100, n_test=50, seed=3)
    b = make_builtin_reviews(n_train=200, n_test=50, seed=3)
    assert _rows(a["test"]) == _rows(b["test"])


def test_different_seeds_give_different_reviews():
    a = make_builtin_reviews(n_train=100, n_test=50, seed=0)
    b = make_builtin_reviews(n_train=100, n_test=50, seed=1)
    assert a["train"]["text"] != b["train"]["text"]
    assert a["test"]["text"] != b["test"]["text"]


def test_labels_are_balanced_and_reviews_are_yelp_sized(reviews):
    assert set(reviews) == {"train", "test"}
    for split, n in (("train", 6000), ("test", 1000)):
        ds = reviews[split]
        assert len(ds) == n
        assert Counter(ds["label"]) == {k: n // 5 for k in range(5)}
        lengths = [len(t.split()) for t in ds["text"]]
        assert 15 <= min(lengths) and max(lengths) <= 60
        assert len(set(ds["text"])) > 0.95 * n  # varied, not a handful of templates


def test_tokenizer_round_trips_known_words(tokenizer):
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == 0
    assert tokenizer.padding_side == "right"
    ids = tokenizer("The FOOD was amazing, service terrible!")["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["the", "food", "was", "amazing", ",", "service", "terrible", "!"]
    assert tokenizer.convert_tokens_to_ids(["zzyzx"]) == [tokenizer.unk_token_id]


def test_tokenizer_training_is_deterministic(reviews, tokenizer):
    again = build_tokenizer(reviews["train"]["text"])
    assert again.get_vocab() == tokenizer.get_vocab()


def test_tokenized_rows_are_right_padded_to_max_length_with_pad_id_zero(tokenized, reviews):
    assert set(tokenized["train"].column_names) == {"input_ids", "attention_mask", "labels"}
    row = tokenized["test"][0]
    assert isinstance(row["input_ids"], torch.Tensor)
    batch = tokenized["train"][:64]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (64, MAX_LEN)
    assert torch.equal(batch["labels"], torch.tensor(reviews["train"]["label"][:64]))
    assert (ids[mask == 0] == 0).all() and (ids[mask == 1] != 0).all()
    lengths = mask.sum(1)
    assert (lengths < MAX_LEN).any()
    assert torch.equal(mask, (torch.arange(MAX_LEN) < lengths[:, None]).long())  # right padding


def test_long_reviews_are_truncated_to_max_length(tokenizer):
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["good " * 100], "label": [3]})})
    row = tokenize_reviews(ds, tokenizer, max_length=8)["train"][0]
    assert row["input_ids"].shape == (8,) and bool(row["attention_mask"].all())


@pytest.mark.parametrize("n_train", [200, 201])
def test_two_ranks_get_disjoint_shards_covering_the_single_rank_epoch(tokenized, n_train):
    small = datasets.DatasetDict({"train": tokenized["train"].select(range(n_train)),
                                  "test": tokenized["test"].select(range(51))})
    _, _, single = make_loaders(small, micro_batch_size=8, rank=0, world_size=1, seed=5)
    for epoch in (0, 1):
        single.set_epoch(epoch)
        order = list(single)
        shards = []
        for rank in (0, 1):
            train, _, sampler = make_loaders(small, micro_batch_size=8, rank=rank, world_size=2, seed=5)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        assert len(shards[0]) == len(shards[1]) == n_train // 2  # drop_last: equal step counts
        assert not set(shards[0]) & set(shards[1])
        assert set(shards[0]) | set(shards[1]) == set(order[: 2 * (n_train // 2)])
    assert set(order) == set(range(n_train))


def test_loaders_yield_fixed_shape_batches_following_the_sampler(tokenized):
    small = datasets.DatasetDict({"train": tokenized["train"].select(range(100)),
                                  "test": tokenized["test"].select(range(51))})
    seen_eval = []
    for rank in (0, 1):
        train, evaluate, sampler = make_loaders(small, micro_batch_size=8, rank=rank, world_size=2, seed=0)
        sampler.set_epoch(3)
        batches = list(train)
        assert len(batches) == 50 // 8
        for b in batches:
            assert set(b) == {"input_ids", "attention_mask", "labels"}
            assert b["input_ids"].shape == b["attention_mask"].shape == (8, MAX_LEN)
        got = torch.cat([b["labels"] for b in batches])
        want = small["train"][list(sampler)[: len(got)]]["labels"]
        assert torch.equal(got, want)
        seen_eval += torch.cat([b["labels"] for b in evaluate]).tolist()
    assert len(seen_eval) == 52  # eval is padded to be even across ranks, never dropped


def test_unknown_dataset_raises_one_line_error_offline(monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    # Both libraries read the variables at import time, which already happened.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)  # datasets 2.x has HF_DATASETS_OFFLINE alone
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # so the name cannot resolve to a local folder
    with pytest.raises(DataUnavailableError) as err:
        load_reviews("no/such-dataset-xyz")
    msg = str(err.value)
    assert "\n" not in msg
    assert "no/such-dataset-xyz" in msg and "--dataset builtin" in msg
    assert isinstance(err.value, RuntimeError)


def test_builtin_name_loads_without_network(monkeypatch, reviews):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("builtin must not hit the hub"))
    ds = load_reviews("builtin", seed=0)
    assert _rows(ds["test"]) == _rows(reviews["test"]) and len(ds["train"]) == len(reviews["train"])


def test_bag_of_words_logistic_regression_learns_the_stars(tokenized, tokenizer):
    def bag(ds: datasets.Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        cols = ds[:]
        x = torch.zeros(len(ds), len(tokenizer))
        x.scatter_(1, cols["input_ids"], 1.0)
        x[:, 0] = 0.0  # padding is not a word
        return x, cols["labels"]

    x_train, y_train = bag(tokenized["train"])
    x_test, y_test = bag(tokenized["test"])
    torch.manual_seed(0)
    linear = torch.nn.Linear(x_train.shape[1], 5)
    opt = torch.optim.Adam(linear.parameters(), lr=0.05)
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(x_train), y_train) + 1e-4 * linear.weight.square().sum()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (linear(x_test).argmax(1) == y_test).float().mean().item()
    print(f"bag-of-words test accuracy: {accuracy:.3f}")
    assert accuracy > 0.45
