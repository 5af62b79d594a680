"""The dashboard's exports: on request, of a finished run when the next begins, and on exit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from instrumented_ddp.wire.output_paths import file_in_the_way

from ddpwatch.export.exporters import write_exports
from ddpwatch.ingest.session import Session


class SessionExports:
    """Writes a session's exports under ``out_dir`` (none without one), says through ``notify``
    what was written or why not, and keeps the last failure in ``export_failure`` for the
    command to print at exit. ``save_screenshot(filename, folder)`` saves the screen, returning its path."""

    def __init__(self, out_dir: Path | None, export_on_exit: bool, notify: Callable[[str], None],
                 save_screenshot: Callable[[str, str], str]) -> None:
        self.out_dir = out_dir
        self.export_on_exit = export_on_exit
        self.notify = notify
        self.save_screenshot = save_screenshot
        self.export_failure: str | None = None  # the last export that could not be written, said at exit

    def export_to(self, session: Session, folder: Path, screenshot: bool = False) -> dict[str, Path] | None:
        """``session``'s exports in ``folder`` (and this screen, ``screenshot``), or None, the
        reason said and kept for the command to print at exit: a folder removed, replaced or
        full costs the exports, never the dashboard, the live view of a run still training."""
        try:
            paths = write_exports(session, folder)
            if screenshot:
                paths["screenshot"] = Path(self.save_screenshot("dashboard.svg", str(folder)))
        except OSError as error:
            why = file_in_the_way(folder) or error.strerror or str(error)
            self.export_failure = f"the exports could not be written to {folder}: {why}"
            self.notify(self.export_failure)
            return None
        return paths

    def on_request(self, session: Session) -> None:
        """The export key: ``session``'s exports and the screen in ``out_dir``, what was written said."""
        if self.out_dir is None:
            self.notify("no output directory: replay with --out DIR to export (ddpwatch replay SESSION --out DIR)")
            return
        paths = self.export_to(session, self.out_dir, screenshot=True)
        if paths is not None:
            self.notify(f"exported {', '.join(p.name for p in paths.values())} to {self.out_dir}")

    def of_finished_run(self, finished: Session) -> str:
        """A finished run's exports in a folder of ``out_dir`` named after it, when exports on
        exit are on and it has reports: the words that say where, or "" where none were written."""
        if self.export_on_exit and self.out_dir is not None and finished.reports:
            folder = self.out_dir / (finished.session_id or "run")
            if self.export_to(finished, folder) is not None:
                return f"; its exports are in {folder}"
        return ""

    def at_exit(self, session: Session) -> None:
        """``session``'s exports in ``out_dir``, when exports on exit are on and it has reports."""
        if self.export_on_exit and self.out_dir is not None and session.reports:
            self.export_to(session, self.out_dir)
