"""The advisor tab: what limits the step now in words, the key that applies the predicted best
(or, on a run that cannot switch, the line to change), the predicted step time against the
bucket cap (``advisor_plot``), the caps the run measured and the fitted cost model."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget
from textual.widgets import Static

from ddpwatch.advisor.advice import Advice, MeasuredCap
from ddpwatch.dashboard.views.advisor_plot import BEST, CURRENT_COLUMN, DEFAULT_COLUMN, EXTRAPOLATED, MEASURED, PREDICTED, WHISKER, plot
from ddpwatch.advisor.bucket_sim import MIB

STYLES = {PREDICTED: "cyan", EXTRAPOLATED: "dim cyan", BEST: "bold green", MEASURED: "bold magenta",
          CURRENT_COLUMN: "yellow", DEFAULT_COLUMN: "dim", WHISKER: "magenta"}
LABEL_WIDTH = 10
PLOT_ROWS = 9
MIN_PLOT_ROWS = 4


class AdvisorPanel(Static):
    """Inside a scrolling pane (the side tabs are a few rows high): what to do and the plot fill
    the rows in view, the legend, measured caps and cost model follow below them."""

    def show(self, advice: Advice | str | None, switchable: bool = True, replay: bool = False) -> None:
        width = max(20, self.size.width - LABEL_WIDTH - 1)
        in_view = self.parent.size.height if isinstance(self.parent, Widget) else 0
        key = (advice, switchable, replay, width, in_view)
        if key != getattr(self, "_shown", None):
            self._shown = key
            self.update(render_advice(advice, width, switchable, in_view, replay))


def megabytes(nbytes: int) -> str:
    return f"{nbytes / MIB:.3g} MB"


def size_text(nbytes: int) -> str:
    """A call's size in the unit that reads: in MB a bias's 768-byte all-reduce reads "0.000732 MB"."""
    if nbytes < 1024:
        return f"{nbytes} B"
    return f"{nbytes / 1024:.3g} KB" if nbytes < MIB else megabytes(nbytes)


def spread_text(measured: MeasuredCap) -> str:
    """``176.0–186.0 over 10 steps``: the 90 % interval of the median, where known."""
    if measured.interval_s is None:
        return f"{measured.steps} steps"
    low, high = measured.interval_s
    return f"{low * 1e3:.1f}–{high * 1e3:.1f} over {measured.steps} steps"


def render_advice(advice: Advice | str | None, width: int, switchable: bool = True, rows_in_view: int = 0,
                  replay: bool = False) -> Text:
    """Most needed first: what limits the step, now against the best, what applies the best
    (``b`` live; a run ddpwatch did not start, its own script's argument; a replay, the next
    run's flags); then the plot, given the rows left in view (``rows_in_view``; 0: ``PLOT_ROWS``)
    but at least ``MIN_PLOT_ROWS``, and its axis; then the legend, the measured caps and the cost model."""
    if advice is None:
        return Text("")
    if isinstance(advice, str):
        return Text(f"bucket advisor: {advice}")
    model, now, top = advice.model, advice.current, advice.best
    change = f"{-advice.gain:+.1%}" if advice.gain >= 0.0005 else "as now"
    action = (script_change_text(top.cap_bytes) if not switchable else next_run_flags_text(advice.strategy, top.cap_bytes)
              if replay else f"b: switch to {advice.strategy} at {megabytes(top.cap_bytes)}")
    comparison = (f"now {megabytes(now.cap_bytes)}: {now.step_s * 1e3:.1f} ms predicted · ",
                  f"best {megabytes(top.cap_bytes)}: {top.step_s * 1e3:.1f} ms ({change})",
                  f" · 25 MB: {advice.default.step_s * 1e3:.1f} ms")
    panel_width = width + LABEL_WIDTH + 1
    above = sum(wrapped_rows(line, panel_width) for line in (advice.words, "".join(comparison), action)) + 1  # + the axis
    plot_rows = max(MIN_PLOT_ROWS, min(PLOT_ROWS, rows_in_view - above)) if rows_in_view else PLOT_ROWS

    text = Text()
    text.append(advice.words + "\n", "bold")
    text.append(comparison[0])
    text.append(comparison[1], "green")
    text.append(comparison[2] + "\n")
    text.append(action + "\n", "bold")
    picture = plot(advice, width, plot_rows)
    for index, row in enumerate(picture.rows):
        label = f"{picture.top_ms:.1f} ms" if index == 0 else f"{picture.bottom_ms:.1f} ms" if index == len(picture.rows) - 1 else ""
        text.append(label.rjust(LABEL_WIDTH) + " ", "dim")
        for char in row:
            text.append(char, STYLES.get(char, ""))
        text.append("\n")
    text.append(" " * (LABEL_WIDTH + 1) + picture.x_axis + "\n", "dim")
    text.append(f"{PREDICTED} predicted  {EXTRAPOLATED} beyond the sizes seen  {BEST} best  {MEASURED}{WHISKER} measured, "
                f"its 90 % interval  {CURRENT_COLUMN} now  {DEFAULT_COLUMN} 25 MB\n", "dim")
    if advice.measured:
        text.append("measured: " + " · ".join(f"{m.strategy} {megabytes(m.cap_bytes)} {m.step_s * 1e3:.1f} ms ({spread_text(m)})"
                                              for m in advice.measured) + "\n")
    text.append(f"cost model: {model.alpha_s * 1e3:.3g} ms + S / {model.busbw_gbps:.3g} GB/s bus bandwidth, fitted on "
                f"{model.samples} calls of {size_text(model.min_bytes)}-{size_text(model.max_bytes)}"
                + (f" ({advice.remembered} of sizes only earlier steps issued)" if advice.remembered else "")
                + f", median error {model.relative_error:.0%}" + (" (through 0: latency not seen)" if model.through_origin else "")
                + "\n" + slowdown_text(advice, switchable and not replay), "dim")
    return text


def slowdown_text(advice: Advice, switchable: bool = True) -> str:
    """How the all-reduces beside backward slow it, as the sweep simulates it (``compute_slowdown``);
    until two caps of the run say, what would: another cap (``+``/``-``) where the run can switch,
    and where it cannot (an attached DDP, a replay) that it stays unmodelled."""
    fit = advice.slowdown
    if fit is not None:
        return (f"backward computes at {1 - fit.lost_share:.0%} of its speed while an all-reduce runs beside it, "
                f"fitted over {fit.segments} segments of the caps run")
    if switchable:
        return ("backward replayed as measured: how the all-reduces beside it slow it needs a second cap whose "
                "all-reduces run through more or less of backward (+ / -)")
    return ("backward replayed as measured: how the all-reduces beside it slow it needs two caps in one run, "
            "so small caps may read faster than they run")


def wrapped_rows(line: str, width: int) -> int:
    """Rows ``line`` takes wrapped at ``width`` columns (by characters: words wrap a little later)."""
    return max(1, -(-len(line) // max(1, width)))


def next_run_flags_text(strategy: str, cap_bytes: int) -> str:
    """What a replayed train.py run, which cannot be switched, is started with to run at ``cap_bytes``."""
    mb = f"{cap_bytes / MIB:.3g}"
    return f"to run at {mb} MB, start train.py with --strategy {strategy} --bucket-mb {mb} (a replay cannot switch)"


def script_change_text(cap_bytes: int) -> str:
    """What a run ddpwatch did not start (``attach``) changes to run at ``cap_bytes``: DDP's
    ``bucket_cap_mb`` counts MiB, as these caps do."""
    mb = f"{cap_bytes / MIB:.3g}"
    return (f"to run at {mb} MB, restart with DistributedDataParallel(..., bucket_cap_mb={mb}) "
            f"(a Trainer: TrainingArguments(ddp_bucket_cap_mb={mb}))")
