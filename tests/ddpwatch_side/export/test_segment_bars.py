"""The per-segment bar: its parts, their cells and the SVG, hand-worked."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from ddpwatch.export.segment_bars import bars_svg, cells, lengths, segment_bar

# Compute 60 %, of which 20 % of the window had communication beside it; exposed 25 %, idle 15 %.
BUCKET = segment_bar("bucket bucket_mb=25 (0-9)", 60.0, 25.0, 15.0, hidden_comm_pct=20.0, overlap_pct=44.4)


def test_bar_splits_compute_into_alone_and_beside_communication() -> None:
    assert BUCKET.parts == (40.0, 20.0, 25.0, 15.0)


def test_hidden_part_is_clamped_into_compute() -> None:
    # means over steps can put the hidden part a rounding above Compute%
    bar = segment_bar("ddp", 10.0, 80.0, 10.0, hidden_comm_pct=10.4, overlap_pct=11.0)
    assert bar.parts == (0.0, 10.0, 80.0, 10.0)


def test_cells_are_the_exact_split_when_it_divides() -> None:
    # 20 cells: 40 % -> 8, 20 % -> 4, 25 % -> 5, 15 % -> 3
    assert cells(BUCKET, 20) == (8, 4, 5, 3)


def test_cells_round_by_largest_remainder_and_fill_the_width() -> None:
    # 7 cells: exact 2.8, 1.4, 1.75, 1.05 -> floors 2, 1, 1, 1 (5); the two largest remainders
    # (.8 compute, .75 exposed) get the 2 cells left
    assert cells(BUCKET, 7) == (3, 1, 2, 1)


def test_a_bars_length_is_its_time_per_sample_against_the_slowest_segments() -> None:
    """100 samples/s is 10 ms a sample, 50 is 20 (the slowest, full length), 80 is 12.5: 0.5,
    1 and 0.625 of the width; an unmeasured rate (0) is drawn at full length."""
    assert lengths([100.0, 50.0, 80.0, 0.0]) == [0.5, 1.0, 0.625, 1.0]
    assert lengths([]) == [] and lengths([0.0]) == [1.0]


def test_a_shorter_bar_splits_its_own_cells() -> None:
    """Half of 20 cells: 10, split 40/20/25/15 % -> exact 4, 2, 2.5, 1.5 -> floors 4, 2, 2, 1 (9);
    the cell left goes to the larger remainder, exposed's .5 (tied with idle's, the earlier part)."""
    half = segment_bar("bucket", 60.0, 25.0, 15.0, hidden_comm_pct=20.0, overlap_pct=44.4, length=0.5)
    assert cells(half, 20) == (4, 2, 3, 1)
    assert sum(cells(segment_bar("tiny", 100.0, 0.0, 0.0, 0.0, 0.0, length=0.01), 20)) == 1  # never less than a cell


def test_an_empty_window_draws_no_cells() -> None:
    assert cells(segment_bar("empty", 0.0, 0.0, 0.0, 0.0, 0.0), 10) == (0, 0, 0, 0)


def test_svg_widths_are_the_percentages_of_the_bar() -> None:
    svg = bars_svg([BUCKET, segment_bar("a < b", 100.0, 0.0, 0.0, 0.0, 0.0)], "session s1")
    root = ElementTree.fromstring(svg)  # well-formed, the label's "<" escaped
    ns = {"svg": "http://www.w3.org/2000/svg"}
    first_row = [r for r in root.findall("svg:rect", ns) if r.get("class") and r.get("y") == "40"]
    # 480 px: 40 % -> 192 from x 260; 20 % -> 96 from 452; 25 % -> 120 from 548; 15 % -> 72 from 668
    assert [(r.get("class"), r.get("x"), r.get("width")) for r in first_row] == [
        ("compute", "260.00", "192.00"), ("hidden", "452.00", "96.00"),
        ("exposed", "548.00", "120.00"), ("idle", "668.00", "72.00")]
    texts = [t.text for t in root.findall("svg:text", ns)]
    assert "a < b" in texts and "Overlap 44 %" in texts
    half = ElementTree.fromstring(bars_svg([segment_bar("half", 100.0, 0.0, 0.0, 0.0, 0.0, length=0.5)], "s"))
    assert [r.get("width") for r in half.findall("svg:rect", ns) if r.get("class")] == ["240.00"]  # half of 480 px
