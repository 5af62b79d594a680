"""Where a command will write is made, or refused in words, before it starts."""

from __future__ import annotations

from pathlib import Path

from instrumented_ddp.wire.output_paths import directory_problem, file_problem


def test_a_directory_is_made_with_its_parents_and_a_file_in_the_way_is_named(tmp_path: Path) -> None:
    traces = tmp_path / "runs" / "profile"
    assert directory_problem("--profile", str(traces)) is None and traces.is_dir()
    assert directory_problem("--profile", str(traces)) is None  # made already: fine
    blocker = tmp_path / "runs" / "notes.txt"
    blocker.write_text("a file where a directory was asked for")
    assert directory_problem("--profile", str(blocker)) == f"--profile {blocker}: {blocker} is a file, not a directory"
    assert directory_problem("--out", str(blocker / "a" / "b")) == f"--out {blocker / 'a' / 'b'}: {blocker} is a file, not a directory"


def test_a_files_directory_is_made_and_the_file_itself_left_alone(tmp_path: Path) -> None:
    final = tmp_path / "new" / "final.pt"
    assert file_problem("--save-final", str(final)) is None
    assert final.parent.is_dir() and not final.exists()  # an earlier run's file would stay until this one ends
    assert file_problem("--save-final", str(tmp_path)) == f"--save-final {tmp_path}: is a directory, not a file"
    blocker = tmp_path / "notes.txt"
    blocker.write_text("")
    assert file_problem("--save-final", str(blocker / "final.pt")) == \
        f"--save-final {blocker / 'final.pt'}: {blocker} is a file, not a directory"
