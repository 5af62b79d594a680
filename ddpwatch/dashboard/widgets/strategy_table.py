"""The advisor tab's strategy table: every strategy at the run's K, its predicted step and held and
peak memory per rank, what the session measured of it beside, and the fastest that fits the
memory budget in words, with the key that switches to it (or, on a run ddpwatch did not start,
the code to change)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ddpwatch.advisor.strategy_advice import StrategyAdvice, StrategyRow

#: What to change in a script of one's own to train each strategy (an attached run cannot switch).
CODE_FOR = {
    "ddp": "DistributedDataParallel(model, bucket_cap_mb=...)",
    "zero1": "DistributedDataParallel(model) with ZeroRedundancyOptimizer(model.parameters(), optimizer_class=AdamW)",
    "zero2": "DeepSpeed's ZeRO stage 2 (torch has no ZeRO-2 of its own)",
    "fsdp": "fully_shard(layer) for each layer, then fully_shard(model)",
}


class StrategyTable(Static):
    def show(self, table: StrategyAdvice | str | None, switchable: bool = True) -> None:
        key = (table, switchable)
        if key != getattr(self, "_shown", None):
            self._shown = key
            self.update(render_strategies(table, switchable))


def render_strategies(table: StrategyAdvice | str | None, switchable: bool = True) -> Text:
    """The words and key first, then a row a strategy, fastest first, the run's own marked."""
    text = Text()
    text.append("Which strategy\n", style="bold")
    if table is None:
        return text
    if isinstance(table, str):
        text.append(table, style="dim")
        return text
    text.append(table.words + "\n")
    best = fastest_fitting(table)
    if best is not None and (best.strategy, best.grad_accum) != (table.run_strategy, table.run_grad_accum):
        if switchable:
            text.append("B", style="bold yellow")
            text.append(f" switches the run to {best.strategy}\n")
        else:
            text.append(f"to train {best.strategy}: {CODE_FOR.get(best.strategy, 'that strategy')}\n", style="yellow")
    budget = f"budget {table.budget_mib / 1024:.3g} GiB a rank" if table.budget_mib is not None else "no memory budget known"
    text.append(f"{'':2}{'strategy':<8} {'K':>2} {'step ms':>8} {'held MiB':>9} {'peak MiB':>9}   measured ({budget})\n", style="dim")
    for row in sorted(table.rows, key=lambda r: r.predicted_ms):
        own = (row.strategy, row.grad_accum) == (table.run_strategy, table.run_grad_accum)
        fits = row.fits(table.budget_mib)
        peak = f"{row.predicted_peak_mib:.0f}" if row.predicted_peak_mib is not None else "—"
        line = f"{'▶ ' if own else '  '}{row.strategy:<8} {row.grad_accum:>2} {row.predicted_ms:8.1f} {row.predicted_held_mib:9.1f} {peak:>9}"
        measured = _measured_text(row)
        text.append(line, style="bold" if row is best else "" if fits else "dim")
        text.append(f"   {measured}\n" if measured else "\n", style="magenta")
    notes = sorted({note for row in table.rows for note in row.notes})
    if notes:
        text.append("modelled, not measured: " + "; ".join(notes) + "\n", style="dim")
    if table.costs:
        text.append("links: " + "; ".join(f"{kind} {cost.source}" for kind, cost in table.costs.items()) + "\n", style="dim")
    return text


def fastest_fitting(table: StrategyAdvice) -> StrategyRow | None:
    fits = [r for r in table.rows if r.fits(table.budget_mib)]
    return min(fits, key=lambda r: r.predicted_ms) if fits else None


def _measured_text(row: StrategyRow) -> str:
    if row.measured_ms is None:
        return ""
    held = f", {row.measured_held_mib:.1f} held" if row.measured_held_mib is not None else ""
    peak = f", {row.measured_peak_mib:.0f} peak" if row.measured_peak_mib is not None else ""
    return f"{row.measured_ms:.1f} ms{held}{peak}"
