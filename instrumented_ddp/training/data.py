"""Data pipeline for the tiny-Llama review classifier (5 classes, Yelp-review-full style).

Why it looks like this:

* No downloads at run time. Training runs are often launched on machines without
  network access (or with a cold Hugging Face cache), and a stalled download on one
  rank hangs every other rank inside the first collective. So the default dataset
  (``builtin``) is generated in-process, and the tokenizer is a word-level one
  trained on the spot with ``tokenizers`` instead of fetched from the hub.
* Deterministic. Every rank builds its own copy of the data and vocabulary; DDP is
  only correct if those copies are identical, so generation uses a private
  ``random.Random(seed)`` (never the global RNG, which other code may touch) and
  tokenizer training has no randomness at all.
* Real data is still one flag away: ``--dataset yelp_review_full`` goes through
  ``datasets.load_dataset`` and fails with a one-line, actionable message when offline.
"""

from __future__ import annotations

import os
import random
from typing import Any, Iterable

import datasets
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from torch.utils.data import DataLoader, DistributedSampler
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "DataUnavailableError",
    "build_tokenizer",
    "load_reviews",
    "make_builtin_reviews",
    "make_loaders",
    "tokenize_reviews",
    "wrap_tokenizer",
]

NUM_LABELS = 5
LABEL_NAMES = ["1 star", "2 star", "3 stars", "4 stars", "5 stars"]  # same as Yelp/yelp_review_full
PAD_TOKEN, UNK_TOKEN = "[PAD]", "[UNK]"
_YELP_ALIASES = {"yelp": "Yelp/yelp_review_full", "yelp_review_full": "Yelp/yelp_review_full"}

# Star-correlated vocabulary, index = label (0 = 1 star ... 4 = 5 stars). Neighbouring
# levels are deliberately close in tone so adjacent stars get confused, as in real Yelp.
_ADJ = [
    ["awful", "terrible", "disgusting", "horrible", "inedible", "filthy", "rude", "appalling"],
    ["disappointing", "bland", "overpriced", "slow", "underwhelming", "lukewarm", "sloppy", "meh"],
    ["okay", "average", "decent", "fine", "forgettable", "acceptable", "passable", "ordinary"],
    ["good", "tasty", "friendly", "solid", "pleasant", "fresh", "reliable", "nice"],
    ["amazing", "outstanding", "perfect", "incredible", "delicious", "fantastic", "phenomenal", "superb"],
]
_VERDICT = [
    ["Never coming back.", "Avoid at all costs.", "I want my money back.", "Worst visit ever."],
    ["Probably will not return.", "I expected a lot more.", "Not worth the price.", "Pretty let down."],
    ["Might come back if nearby.", "Nothing special overall.", "It was fine, I guess.", "Mixed feelings."],
    ["Would come back.", "Worth a visit.", "Happy with it overall.", "I would recommend it."],
    ["Absolutely love this place!", "Best in town, hands down.", "Cannot wait to go back!", "Highly recommend!"],
]
_PLACES = ["restaurant", "diner", "cafe", "taco place", "pizza joint", "sushi bar", "bakery", "hair salon",
           "auto shop", "nail salon", "hotel", "bar", "coffee shop", "grocery store", "brunch spot", "gym"]
_ASPECTS = ["food", "service", "staff", "price", "atmosphere", "wait", "coffee", "burger", "pizza",
            "room", "haircut", "manager", "menu", "dessert", "parking situation", "music", "portion"]
_WHO = ["My friend", "My wife", "My husband", "My coworker", "My sister", "My dad", "Our group", "My roommate"]
_OPINION = [
    "The {a} was {j}.", "Honestly the {a} was {j}.", "I thought the {a} was {j}.", "{J} {a}.",
    "The {a} here is {j} and the {b} was {k}.", "{w} said the {a} was {j}.", "Really {j} {a} tonight.",
]
_FILLER = [
    "We came here on a {d} for {m}.", "I ordered the {o} and a drink.", "{w} got the {o}.", "We sat near the window.",
    "It is right next to the {p} on Main Street.", "Parking was on the street.", "{w} picked this {p}.",
    "We had a reservation for four.", "It was my second time at this {p}.", "They take cards and cash.",
    "The {p} was busy when we arrived.", "I stopped by after work.", "The menu has a lot of choices.",
    "We were in town for the weekend.", "This {p} opened last year.", "I usually go to a different {p}.",
    "Then we split the {o}.", "Our server was named Sam.", "Prices are about what you would expect.",
]
_ORDERS = ["pad thai", "cheeseburger", "latte", "fish tacos", "club sandwich", "ramen", "pepperoni pizza",
           "croissant", "trim", "oil change", "manicure", "salad", "pancakes", "wings", "nachos", "omelet"]
_DAYS = ["Monday", "Tuesday", "Friday night", "Saturday", "Sunday morning", "weekday", "holiday"]
_MEALS = ["lunch", "dinner", "breakfast", "brunch", "a quick bite", "a birthday", "date night"]
# Probability that one opinion phrase is drawn from the review's star level offset by k.
_OFFSETS, _OFFSET_WEIGHTS = [0, -1, 1, -2, 2], [0.55, 0.16, 0.16, 0.065, 0.065]


class DataUnavailableError(RuntimeError):
    """A dataset could not be loaded; the message is one line so launchers can print it as-is."""


def _jitter(rng: random.Random, label: int) -> int:
    """Star level of one phrase: usually the review's own, sometimes a neighbour (mixed reviews)."""
    return min(NUM_LABELS - 1, max(0, label + rng.choices(_OFFSETS, _OFFSET_WEIGHTS)[0]))


def _opinion(rng: random.Random, star: int) -> str:
    """One sentiment sentence; sometimes negated ("not good") so single words are unreliable."""
    if star != 2 and rng.random() < 0.12:  # negated mirror level: "not good" for 2 stars
        j = "not " + rng.choice(_ADJ[4 - star])
    else:
        j = rng.choice(_ADJ[star])
    k = rng.choice(_ADJ[min(4, max(0, star + rng.choice([-1, 0, 0, 1])))])
    a, b = rng.sample(_ASPECTS, 2)
    return rng.choice(_OPINION).format(a=a, b=b, j=j, k=k, J=j.capitalize(), w=rng.choice(_WHO))


def _filler(rng: random.Random) -> str:
    """A neutral sentence, so reviews have Yelp-like length without extra label signal."""
    return rng.choice(_FILLER).format(d=rng.choice(_DAYS), m=rng.choice(_MEALS), o=rng.choice(_ORDERS),
                                      p=rng.choice(_PLACES), w=rng.choice(_WHO))


def _review(rng: random.Random, label: int) -> str:
    """Shuffle 2-4 jittered opinions with neutral filler; resample until Yelp-like length."""
    while True:
        parts = [_opinion(rng, _jitter(rng, label)) for _ in range(rng.randint(2, 4))]
        parts += [_filler(rng) for _ in range(rng.randint(1, 4))]
        rng.shuffle(parts)
        if rng.random() < 0.6:
            parts.append(rng.choice(_VERDICT[_jitter(rng, label)]))
        if rng.random() < 0.1:  # shouting and "!!", like real user text
            parts = [p.upper() if rng.random() < 0.3 else p.replace(".", "!!") for p in parts]
        text = " ".join(parts)
        if 15 <= len(text.split()) <= 60:
            return text


def _split(n: int, rng: random.Random) -> dict[str, list]:
    """Exactly balanced labels (up to n % 5), in shuffled order."""
    labels = [i % NUM_LABELS for i in range(n)]
    rng.shuffle(labels)
    return {"text": [_review(rng, y) for y in labels], "label": labels}


def make_builtin_reviews(n_train: int = 6000, n_test: int = 1000, seed: int = 0) -> datasets.DatasetDict:
    """Synthetic Yelp-style reviews: learnable but not trivially separable, identical on every rank.

    Each split has its own RNG stream so the test set does not change when n_train does.
    """
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=LABEL_NAMES)})
    out = datasets.DatasetDict()
    for split, n in (("train", n_train), ("test", n_test)):
        rng = random.Random(f"builtin-reviews/{seed}/{split}")  # str seeds hash with sha512: stable across runs
        out[split] = datasets.Dataset.from_dict(_split(n, rng), features=features)
    return out


def load_reviews(name: str, seed: int = 0) -> datasets.DatasetDict:
    """Resolve ``--dataset``: "builtin" never touches the network; anything else may, and failing
    that we raise one clear line instead of a multi-page hub traceback on every rank."""
    if name == "builtin":
        return make_builtin_reviews(seed=seed)
    target = _YELP_ALIASES.get(name, name)
    try:
        if os.path.isfile(os.path.join(target, "dataset_dict.json")):
            ds = datasets.load_from_disk(target)  # a DatasetDict saved with save_to_disk
        else:
            ds = datasets.load_dataset(target)
    except Exception as exc:  # offline, not found, bad format: all mean "pick another dataset"
        reason = " ".join(str(exc).split()) or type(exc).__name__
        reason = reason if len(reason) <= 200 else reason[:197] + "..."
        raise DataUnavailableError(
            f"cannot load dataset {name!r} ({type(exc).__name__}: {reason}); use --dataset builtin to train offline"
        ) from exc
    if not isinstance(ds, datasets.DatasetDict) or not {"train", "test"} <= set(ds):
        raise DataUnavailableError(f"dataset {name!r} has no train/test splits; use --dataset builtin")
    return ds


def build_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Word-level vocabulary trained on the training texts: no hub download, and for a tiny model a
    word vocabulary keeps sequences short. Training is deterministic (counts, ties broken by string)."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, UNK_TOKEN],
                                        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The trained vocabulary as the tokenizer the model and loaders use (also one read back from disk)."""
    assert tok.token_to_id(PAD_TOKEN) == 0, "padding relies on [PAD] being id 0"
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN, padding_side="right")


def tokenize_reviews(
    ds: datasets.DatasetDict, tokenizer: PreTrainedTokenizerBase, max_length: int = 64
) -> datasets.DatasetDict:
    """Pad every example to exactly max_length so all micro-batches have one shape: step times
    across ranks are then comparable and nothing needs a custom collate function."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(batch["text"], padding="max_length", truncation=True, max_length=max_length)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": batch["label"]}

    keep = ["input_ids", "attention_mask", "labels"]
    out = datasets.DatasetDict()
    for split, d in ds.items():
        mapped = d.map(encode, batched=True, remove_columns=d.column_names, desc=f"tokenize {split}")
        mapped.set_format("torch", columns=keep)
        out[split] = mapped
    return out


def make_loaders(
    tokenized: datasets.DatasetDict, micro_batch_size: int, rank: int, world_size: int, seed: int,
    pin_memory: bool = False,
) -> tuple[DataLoader, DataLoader, DistributedSampler]:
    """Shard by rank explicitly (no process group needed, so this also works in tests).

    Train: shuffled with a shared seed and drop_last, so every rank sees a disjoint shard of equal
    size and runs the same number of steps (an uneven count would hang in allreduce). Eval: not
    shuffled, no drop; the sampler pads by repeating a few examples so ranks stay in lockstep.
    num_workers=0 keeps the per-rank process tree simple for the watcher. Call
    ``train_sampler.set_epoch(epoch)`` each epoch, or every epoch sees the same order.
    ``pin_memory`` (for a CUDA device): batches in page-locked memory, so ``.to(device,
    non_blocking=True)`` is a true asynchronous copy and the host does not wait for it.
    """
    # Typed by hand: ``datasets`` has no type information, and a row is a dict of its columns.
    train_sampler: DistributedSampler[dict[str, Any]] = DistributedSampler(
        tokenized["train"], num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    eval_sampler: DistributedSampler[dict[str, Any]] = DistributedSampler(
        tokenized["test"], num_replicas=world_size, rank=rank, shuffle=False, drop_last=False)
    train_loader = DataLoader(tokenized["train"], batch_size=micro_batch_size, sampler=train_sampler,
                              num_workers=0, drop_last=True, pin_memory=pin_memory)
    eval_loader = DataLoader(tokenized["test"], batch_size=micro_batch_size, sampler=eval_sampler, num_workers=0)
    return train_loader, eval_loader, train_sampler
