"""What a training forward was given and what it returned, read without a device sync: its
samples and tokens (``batch_size_and_tokens``), its loss (``loss_of``), the tensors of its output
a backward reaches (``output_tensors``); and the step's mean loss over its micro-steps
(``mean_loss``). ``attach`` reads every forward of a loop it did not write through these: the
loop passes whatever its model takes, and the model returns whatever it returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["batch_size_and_tokens", "describe", "loss_of", "mean_loss", "output_tensors", "tensors_in"]


def batch_size_and_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, Any]:
    """Samples and tokens of one forward's inputs, read from shapes (no device sync): samples are
    the leading size of the first tensor (``input_ids`` first); tokens are the attention mask's
    positions it keeps where there is one of one or two dimensions (its ones counted, not summed:
    an fp16 mask of more than 65,504 ones summed to inf; a device tensor, read when the step
    resolves), else the positions of an integer ``input_ids``, else 0: a mask of four dimensions
    (the additive ``(batch, 1, query, key)`` masks a Hugging Face model also takes, 0 where a
    position is kept, the dtype's least where not) says nothing of tokens by its sum. A batch passed whole is looked into, one level: a dict
    (``model(batch)``) by its names, a list or tuple (PyTorch Lightning's ``(batch, batch_idx)``,
    its batch ``[x, y]``) by position."""
    named = dict(kwargs)
    positional: list[Any] = []
    for arg in args:
        if isinstance(arg, dict):
            positional += arg.values()
            for name, value in arg.items():
                named.setdefault(name, value)
        elif isinstance(arg, (list, tuple)):
            positional += arg
        else:
            positional.append(arg)
    tensors = [t for t in tensors_in([named.get("input_ids"), *positional, *named.values()]) if t.dim() > 0]
    samples = int(tensors[0].shape[0]) if tensors else 0
    mask = named.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() <= 2:
        return samples, torch.count_nonzero(mask)
    ids = named.get("input_ids", positional[0] if positional else None)
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        return samples, ids.numel()
    return samples, 0


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss a forward returned, where it returned one: a Hugging Face ``ModelOutput``'s
    ``loss``, a dict's ``"loss"`` (a Lightning ``training_step``'s), the output itself where it is
    one number, or the one number of a tuple or list (nanoGPT's ``(logits, loss)``). A loss
    computed outside the model is not seen."""
    if isinstance(output, torch.Tensor):
        candidates: list[Any] = [output]
    elif isinstance(output, (tuple, list)):
        candidates = list(output)
    elif isinstance(output, dict):
        candidates = [output.get("loss")]
    else:
        candidates = [getattr(output, "loss", None)]
    numbers = [t for t in tensors_in(candidates) if t.numel() == 1 and t.is_floating_point()]
    return numbers[0] if len(numbers) == 1 else None


def describe(value: Any) -> str:
    """``a tensor of shape (4, 3)``, ``a float``: what was passed, in a few words."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def mean_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The micro-steps' mean loss, on the device of any that is not on the host: a number given
    to ``record_loss`` is a host tensor, and stacking it with a device loss of the same step
    (one micro-step logged with ``.item()``, the next not) raised. The host ones are copied over
    (a few bytes, never a wait for the device)."""
    device = next((loss.device for loss in losses if loss.device.type != "cpu"), None)
    return torch.stack([loss.reshape(()).float() if device is None else loss.reshape(()).float().to(device, non_blocking=True)
                        for loss in losses]).mean()


def tensors_in(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among ``values``, in order (a batch, an output: anything else is left)."""
    return [value for value in values if isinstance(value, torch.Tensor)]


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The top-level tensors of a forward's output that backward can reach: a tensor, a tuple or
    list, a dict or a Hugging Face ``ModelOutput`` (a dict)."""
    if isinstance(output, torch.Tensor):
        values: Iterable[Any] = [output]
    elif isinstance(output, dict):
        values = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    else:
        values = []
    return [t for t in tensors_in(values) if t.requires_grad]
