"""A job's ddpwatch settings from its environment (``publish.watch_environment``): a flag or an
argument wins, an empty variable is unset, a variable that cannot mean what it names is one line;
``attach`` under ``DDPWATCH_DISABLE=1`` installs nothing, and ``train.py`` reads all three."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from instrumented_ddp.attachment.attachment import AttachError
from instrumented_ddp.attachment.disabled_watch import DisabledWatch
from instrumented_ddp.publish.watch_environment import (ADDRESS_ENV, DISABLE_ENV, KEY_ENV, WatchEnvironmentError, watch_address,
                                                        watch_key_file, watching_disabled)
from instrumented_ddp.training.train import parse_args
from instrumented_ddp.wire.endpoints import DEFAULT_ADDRESS


def test_an_argument_wins_over_its_variable_and_an_empty_variable_is_unset() -> None:
    env = {ADDRESS_ENV: "tcp://127.0.0.1:7000", KEY_ENV: "/keys/client.json"}
    assert watch_address("tcp://127.0.0.1:6000", env) == "tcp://127.0.0.1:6000"
    assert watch_address(None, env) == "tcp://127.0.0.1:7000"
    assert watch_address(None, {ADDRESS_ENV: ""}) == DEFAULT_ADDRESS
    assert watch_address(None, {}) == DEFAULT_ADDRESS
    assert watch_key_file("/mine.json", env) == "/mine.json"
    assert watch_key_file(None, env) == "/keys/client.json"
    assert watch_key_file(None, {KEY_ENV: ""}) is None


@pytest.mark.parametrize(("value", "disabled"), [("1", True), ("true", True), ("YES", True), (" on ", True),
                                                 ("0", False), ("", False), ("false", False), ("off", False)])
def test_disable_reads_the_usual_words_for_yes_and_no(value: str, disabled: bool) -> None:
    assert watching_disabled({DISABLE_ENV: value}) is disabled


def test_disable_set_to_anything_else_is_one_line_naming_the_variable() -> None:
    with pytest.raises(WatchEnvironmentError, match=r"^DDPWATCH_DISABLE='maybe': set it to 1 to watch nothing"):
        watching_disabled({DISABLE_ENV: "maybe"})
    assert watching_disabled({}) is False


def test_attach_under_disable_returns_a_watch_that_does_nothing_and_touches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group, no DDP: an attach that looked would refuse both, so this one did not look."""
    import instrumented_ddp

    monkeypatch.setenv(DISABLE_ENV, "1")
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = instrumented_ddp.attach(model, optimizer)
    assert isinstance(watch, DisabledWatch)
    assert not model._forward_hooks and not model._forward_pre_hooks and not hasattr(model, "_ddpwatch_attached")
    ran = []
    with watch.paused("evaluate"), watch.computing("ema"):
        ran.append(True)
    watch.record_loss(torch.tensor(1.0))
    watch.record_evaluation({"eval_loss": 0.5})
    watch.wait_ends(watch.wait_begins())
    watch.detach()
    assert ran == [True]


def test_attach_with_a_wrong_disable_is_one_line_and_nothing_attached(monkeypatch: pytest.MonkeyPatch) -> None:
    import instrumented_ddp

    monkeypatch.setenv(DISABLE_ENV, "sometimes")
    model = nn.Linear(2, 2)
    with pytest.raises(AttachError, match=r"^instrumented_ddp.attach: DDPWATCH_DISABLE='sometimes'"):
        instrumented_ddp.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_attach_reads_the_address_from_the_environment_where_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The address read is checked as a given one is: one beyond loopback without a key is
    refused, naming it (the model's own checks are passed over here: they come first)."""
    import instrumented_ddp
    from instrumented_ddp.attachment import attachment

    monkeypatch.setattr(attachment, "attach_problem", lambda model, optimizer: None)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv(ADDRESS_ENV, "tcp://10.0.0.5:5555")
    model = nn.Linear(2, 2)
    with pytest.raises(AttachError, match=r"^instrumented_ddp.attach: address tcp://10.0.0.5:5555 is not loopback: pass watch_key="):
        instrumented_ddp.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setenv(KEY_ENV, "/no/such/client.json")  # the key's variable is read too: its file is looked for
    with pytest.raises(AttachError, match=r"/no/such/client.json"):
        instrumented_ddp.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_train_py_reads_the_three_variables_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv(ADDRESS_ENV, "tcp://127.0.0.1:7001")
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert parse_args([]).watch == "tcp://127.0.0.1:7001"
    assert parse_args(["--watch", "tcp://127.0.0.1:7002"]).watch == "tcp://127.0.0.1:7002"
    assert parse_args([]).no_watch is False
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert parse_args([]).no_watch is True
    monkeypatch.setenv(DISABLE_ENV, "2")
    with pytest.raises(SystemExit) as exited:
        parse_args([])
    assert exited.value.code == 2
    monkeypatch.setenv(DISABLE_ENV, "0")
    monkeypatch.setenv(ADDRESS_ENV, "tcp://10.0.0.5:5555")
    with pytest.raises(SystemExit):  # beyond loopback, no key: refused as the flag is
        parse_args([])
