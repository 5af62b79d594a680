"""What ``attach`` reads off a forward it did not write: samples and tokens from its inputs, the
loss and the tensors a backward reaches from its output, the step's mean loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.modeling_outputs import SequenceClassifierOutput

from instrumented_ddp.attachment.forward_values import batch_size_and_tokens, describe, loss_of, mean_loss, output_tensors


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    ((), {"input_ids": torch.zeros(4, 7, dtype=torch.long), "attention_mask": torch.ones(4, 7)}, (4, 28)),
    ((torch.zeros(3, 5, dtype=torch.long),), {}, (3, 15)),  # token ids with no mask: every position
    ((torch.zeros(8, 10),), {}, (8, 0)),  # features, not tokens
    ((), {"labels": torch.zeros(2)}, (2, 0)),
    ((), {}, (0, 0)),
    # a batch passed whole: Lightning's (batch, batch_idx), a dict handed to model(batch)
    (([torch.zeros(16, 256), torch.zeros(16, dtype=torch.long)], 3), {}, (16, 0)),
    (({"input_ids": torch.zeros(2, 9, dtype=torch.long), "attention_mask": torch.ones(2, 9)},), {}, (2, 18)),
    (({"input_ids": torch.zeros(5, 4, dtype=torch.long)},), {}, (5, 20)),
    # the mask's kept positions are counted, not summed: 3 of 4 and 1 of 4 kept, 4 in all
    ((), {"input_ids": torch.zeros(2, 4, dtype=torch.long),
          "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])}, (2, 4)),
    # an fp16 mask of 65,536 ones: summed in fp16 it is inf (65,504 is fp16's largest), counted 65,536
    ((), {"input_ids": torch.zeros(64, 1024, dtype=torch.long),
          "attention_mask": torch.ones(64, 1024, dtype=torch.half)}, (64, 65536)),
    # an additive mask of four dimensions (0 kept, the dtype's least not) says nothing of tokens by
    # its sum (-inf here): the ids' positions, 2 x 16
    ((), {"input_ids": torch.zeros(2, 16, dtype=torch.long),
          "attention_mask": torch.zeros(2, 1, 16, 16).index_fill_(3, torch.arange(12, 16), torch.finfo(torch.float).min)},
     (2, 32)),
])
def test_samples_and_tokens_come_from_the_forwards_inputs(args: tuple[Any, ...], kwargs: dict[str, Any],
                                                         expected: tuple[int, float]) -> None:
    samples, tokens = batch_size_and_tokens(args, kwargs)
    assert (samples, float(tokens)) == expected


@pytest.mark.parametrize(("output", "loss"), [
    (SequenceClassifierOutput(loss=torch.tensor(2.5), logits=torch.zeros(4, 3)), 2.5),  # a Hugging Face ModelOutput
    (torch.tensor(1.5), 1.5),  # a model that returns its loss
    ((torch.zeros(4, 3), torch.tensor(0.5)), 0.5),  # nanoGPT's (logits, loss)
    (torch.zeros(4, 3), None),  # logits: the loss is computed outside the model
    ((torch.tensor(1.0), torch.tensor(2.0)), None),  # two numbers: which one is the loss is not said
    (torch.tensor(3), None),  # an integer count is not a loss
    ({"loss": torch.tensor(0.25), "accuracy": torch.tensor(0.9)}, 0.25),  # a Lightning training_step's dict
])
def test_the_loss_is_read_where_the_forward_returns_one(output: Any, loss: float | None) -> None:
    found = loss_of(output)
    assert (None if found is None else found.item()) == loss


def test_the_tensors_a_backward_reaches_are_the_outputs_top_level_ones_that_need_gradients() -> None:
    weight = torch.ones(3, requires_grad=True)
    logits, loss, count = weight * 2, (weight * 3).sum(), torch.tensor(7)
    assert output_tensors(logits) == [logits]
    assert output_tensors((logits, count, loss)) == [logits, loss]  # an integer count needs no gradient
    assert output_tensors(SequenceClassifierOutput(loss=loss, logits=logits)) == [loss, logits]
    assert output_tensors({"loss": loss, "nested": (logits,)}) == [loss]  # one level only
    assert output_tensors(torch.zeros(3)) == []  # no graph: a forward under no_grad
    assert output_tensors("text") == []


def test_the_steps_loss_is_the_mean_of_its_micro_steps_whatever_shape_each_was_given_in() -> None:
    # a 0-d loss, a one-element one (record_loss of a float becomes a host tensor), a half one
    losses = [torch.tensor(1.0), torch.tensor([2.0]), torch.tensor(6.0, dtype=torch.float16)]
    mean = mean_loss(losses)
    assert mean.shape == () and mean.dtype == torch.float32 and mean.item() == 3.0


def test_what_was_passed_is_described_in_a_few_words() -> None:
    assert describe(torch.zeros(4, 3)) == "a tensor of shape (4, 3)"
    assert describe(1.5) == "a float"
    assert describe([1]) == "a list"
