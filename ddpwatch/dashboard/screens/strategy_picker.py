"""``s``: choose a strategy, bucket size and accumulation, and ask every rank to switch."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList

from instrumented_ddp.wire.messages import bucket_mb_problem
from instrumented_ddp.wire.kinds import STRATEGY_NAMES

DESCRIPTIONS = {
    "simple": "all-reduce every gradient after backward",
    "ga": "simple + gradient accumulation with no_sync",
    "hook": "synchronous all-reduce in each gradient hook",
    "async": "async all-reduce in each gradient hook",
    "bucket": "async all-reduce over size-capped flat buckets",
    "ddp": "torch DistributedDataParallel",
    "zero1": "bucket + optimizer state sharded (ZeRO-1)",
    "zero2": "reduce-scatter buckets, gradients sharded too (ZeRO-2)",
    "fsdp": "torch FSDP2 fully_shard: parameters sharded too",
}


@dataclass(frozen=True)
class SwitchChoice:
    strategy: str
    bucket_mb: float | None
    grad_accum: int | None


class StrategyPicker(ModalScreen[SwitchChoice | None]):
    BINDINGS = [("escape", "cancel", "cancel")]

    def __init__(self, current: str, bucket_mb: float | None, grad_accum: int | None) -> None:
        super().__init__()
        self.current, self.bucket_mb, self.grad_accum = current, bucket_mb, grad_accum

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-box"):
            yield Label("[b]Switch every rank to[/b]")
            yield OptionList(*(f"{name:7} {DESCRIPTIONS[name]}" for name in STRATEGY_NAMES), id="picker-strategies")
            with Horizontal(id="picker-settings"):
                yield Label("bucket MB")
                yield Input(str(self.bucket_mb or ""), placeholder="keep", id="picker-bucket", type="number")
                yield Label("grad accum")
                yield Input(str(self.grad_accum or ""), placeholder="keep", id="picker-accum", type="integer")
            yield Label("", id="picker-error")
            with Horizontal(id="picker-buttons"):
                yield Button("Switch", variant="primary", id="picker-switch")
                yield Button("Cancel", id="picker-cancel")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = STRATEGY_NAMES.index(self.current) if self.current in STRATEGY_NAMES else 0
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "picker-switch":
            self._submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def _submit(self) -> None:
        index = self.query_one(OptionList).highlighted or 0
        bucket_text = self.query_one("#picker-bucket", Input).value.strip()
        accum_text = self.query_one("#picker-accum", Input).value.strip()
        try:
            bucket_mb = float(bucket_text) if bucket_text else None
            grad_accum = int(accum_text) if accum_text else None
            if (bucket_mb is not None and bucket_mb_problem(bucket_mb)) or (grad_accum is not None and grad_accum < 1):
                raise ValueError
        except ValueError:  # "1e400" passes the number input and reads as inf: no rank could take it
            self.query_one("#picker-error", Label).update("[red]bucket MB must be a finite number > 0 and grad accum ≥ 1[/red]")
            return
        self.dismiss(SwitchChoice(STRATEGY_NAMES[index], bucket_mb, grad_accum))
