"""The built-in reviews, tokenized, kept on disk between runs.

Why: generating the 7,000 reviews, training their word vocabulary and tokenizing them costs
seconds on every rank of every run, for a result that is a pure function of the seed, the token
length and this package's code. So the first run on a machine saves it (``datasets``' arrow files
and the tokenizer's JSON) and every later run loads it, far faster.

The folder is ``$DDPWATCH_DATA_CACHE``, else ``$XDG_CACHE_HOME/ddpwatch``, else
``~/.cache/ddpwatch``; ``DDPWATCH_DATA_CACHE=off`` builds afresh every run. An entry is named by a
hash of everything it is made from (the seed, the length, the source of ``data.py`` and of this
file, the versions of ``datasets``, ``tokenizers`` and ``transformers``), so an edit to the data's
code is never read from a stale entry. Ranks that start together may all build it: each writes a
folder of its own and renames it into place, so a reader sees a whole entry or none. A cache that
cannot be written or read is only slower: the data is built and the run goes on, told why once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import datasets
import tokenizers
import transformers
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from instrumented_ddp.training import data

__all__ = ["CACHE_ENV", "builtin_reviews_tokenized", "cache_folder", "entry_name"]

CACHE_ENV = "DDPWATCH_DATA_CACHE"
_OFF = {"", "0", "off", "no", "none", "false"}
_COLUMNS = ["input_ids", "attention_mask", "labels"]


def cache_folder(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path | None:
    """Where entries are kept, or None where the cache is turned off."""
    chosen = environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in _OFF else Path(chosen).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddpwatch"


def entry_name(seed: int, max_length: int) -> str:
    """The entry's folder name: a hash of all that makes it, so that a change to any is a new entry."""
    digest = hashlib.sha256()
    for source in (data.__file__, __file__):
        digest.update(Path(source).read_bytes())
    for part in (seed, max_length, datasets.__version__, tokenizers.__version__, transformers.__version__):
        digest.update(f"\0{part}".encode())
    return f"builtin-reviews-{digest.hexdigest()[:20]}"


def builtin_reviews_tokenized(
    seed: int, max_length: int, folder: Path | None,
) -> tuple[datasets.DatasetDict, PreTrainedTokenizerFast, str | None]:
    """The built-in reviews tokenized to ``max_length``, their tokenizer, and why the cache in
    ``folder`` (``cache_folder()``'s; None: none) could not be used, or None where it was."""
    if folder is None:
        return (*_build(seed, max_length), None)
    entry = folder / entry_name(seed, max_length)
    problem = None
    if entry.exists():
        try:
            return (*_load(entry), None)
        except Exception as error:  # an entry damaged by hand or by a full disk: built again, and replaced
            problem = f"the kept built-in data in {entry} could not be read ({_one_line(error)}): built again"
    tokenized, tokenizer = _build(seed, max_length)
    try:
        _save(entry, tokenized, tokenizer, replace=problem is not None)
    except OSError as error:
        problem = (f"cannot keep the built-in data in {folder} ({_one_line(error)}): it is built afresh each run; "
                   f"set {CACHE_ENV} to a writable folder, or to off")
    return tokenized, tokenizer, problem


def _build(seed: int, max_length: int) -> tuple[datasets.DatasetDict, PreTrainedTokenizerFast]:
    reviews = data.make_builtin_reviews(seed=seed)
    tokenizer = data.build_tokenizer(reviews["train"]["text"])
    return data.tokenize_reviews(reviews, tokenizer, max_length), tokenizer


def _load(entry: Path) -> tuple[datasets.DatasetDict, PreTrainedTokenizerFast]:
    tokenized = datasets.load_from_disk(str(entry / "reviews"))
    if not isinstance(tokenized, datasets.DatasetDict) or set(tokenized) != {"train", "test"}:
        raise ValueError("not the train and test splits")
    tokenized.set_format("torch", columns=_COLUMNS)
    return tokenized, data.wrap_tokenizer(Tokenizer.from_file(str(entry / "tokenizer.json")))


def _save(entry: Path, tokenized: datasets.DatasetDict, tokenizer: PreTrainedTokenizerFast, replace: bool) -> None:
    """Written beside the entry, then renamed into place: a whole entry or none, whoever writes at once."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        tokenized.save_to_disk(str(building / "reviews"))
        tokenizer.backend_tokenizer.save(str(building / "tokenizer.json"))
        if replace:
            shutil.rmtree(entry, ignore_errors=True)
        try:
            building.rename(entry)
        except OSError:
            if not entry.is_dir():  # not another rank's entry, renamed in first: a real failure
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."
