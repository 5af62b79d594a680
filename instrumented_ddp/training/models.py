"""The model under training: a scaled-down SmolLM2 by default, any Hugging Face checkpoint on request.

The default is built from a config, not downloaded, so a fresh machine trains at once; its
architecture is SmolLM2's (Llama with grouped-query attention, SiLU MLP, RMSNorm, rotary
embeddings) so the gradients, tensor count and bucket layout behave like the real thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerBase,
)


class ModelUnavailableError(RuntimeError):
    """A checkpoint that is neither on disk nor downloadable; the message is one line."""


#: SmolLM2's architecture (Llama with GQA, SiLU, RMSNorm, RoPE θ=1e5) at the sizes built in.
#: ``tiny``: SmolLM2-360M's shape shrunk to 2.4 M parameters (with the built-in vocabulary), so a
#: CPU trains it at once.
#: ``small``: SmolLM2-135M's own shape (30 layers, hidden 576, 9 query and 3 key/value heads),
#: 106 M parameters with the built-in vocabulary: big enough to keep a GPU busy, so kernel
#: time, not Python launching kernels, sets the step (what ``ddpwatch doctor`` needs).
BUILT_IN_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 3,
             "num_key_value_heads": 1, "max_position_embeddings": 256},
    "small": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "max_position_embeddings": 2048},
}


def smollm2_config(size: str, vocab_size: int, num_labels: int, pad_token_id: int = 0) -> LlamaConfig:
    """The keywords go in as one untyped dict because they span transformers versions:
    ``rope_theta`` is transformers 4's keyword, which 5 still takes and files under
    ``rope_parameters``; 5's typed ``LlamaConfig`` names neither it nor ``num_labels`` (a
    ``PreTrainedConfig`` keyword), though both take effect there."""
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        **BUILT_IN_SHAPES[size],
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "num_labels": num_labels,
        "pad_token_id": pad_token_id,
    }
    return LlamaConfig(**settings)


def build_tiny_model(vocab_size: int, num_labels: int, pad_token_id: int = 0) -> nn.Module:
    return build_built_in_model("tiny", vocab_size, num_labels, pad_token_id)


def build_built_in_model(size: str, vocab_size: int, num_labels: int, pad_token_id: int = 0) -> nn.Module:
    """``tiny`` or ``small``, built from its config: nothing to download."""
    return LlamaForSequenceClassification(smollm2_config(size, vocab_size, num_labels, pad_token_id))


@dataclass
class PretrainedBundle:
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase


def load_pretrained(name_or_path: str, num_labels: int) -> PretrainedBundle:
    """``from_pretrained`` for a local path or a hub name (cached or downloadable)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=num_labels)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelUnavailableError(
            f"cannot load model {name_or_path!r}: {reason} (use --model tiny to train the built-in model)"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return PretrainedBundle(model, tokenizer)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
