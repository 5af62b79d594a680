"""``--wandb``: the step and segment scalars (``step_scalars``) logged to a Weights & Biases run,
one run per session, by the listener, never the ranks.

The first run starts with the command, before anything listens, so a W&B that cannot start
(not logged in, no network in online mode) is one line and exit 2 rather than a stall later;
it is named and given its config (session, strategy, world size) once the session's hello is
in. ``WANDB_MODE=offline`` writes the run without a network (``wandb sync`` uploads it later);
``WANDB_PROJECT``, ``WANDB_NAME``, ``WANDB_ENTITY`` and ``WANDB_DIR`` are read by wandb itself,
and a flag wins over them. W&B's own sampling of this machine is off: the figures of the ranks'
devices are ddpwatch's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpwatch.export.step_scalars import ScalarRows
from ddpwatch.ingest.session import Session

WANDB_EXTRA = "--wandb needs the wandb extra: pip install 'ddpwatch[wandb]'"
LOG_EVERY_S = 1.0  # rows are logged at most this often


class WandbScalars:
    """Logs each session's rows to a W&B run of its own. ``project`` and ``run_name``: the flags
    (None: ``WANDB_PROJECT``, else ``ddpwatch``; ``WANDB_NAME``, else the session's id);
    ``directory``: where the run's files go where ``WANDB_DIR`` is unset."""

    name = "--wandb"

    def __init__(self, project: str | None, run_name: str | None, directory: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(WANDB_EXTRA) from None
        self._wandb = wandb
        self.project = project or os.environ.get("WANDB_PROJECT") or "ddpwatch"
        self.run_name = run_name or os.environ.get("WANDB_NAME") or None
        self.directory = directory
        self._session: Session | None = None
        self._rows = ScalarRows()
        self._logged_at = float("-inf")
        self._segment_values: dict[str, float] = {}  # the newest segment row's: the run's summary at the end
        self.run: Any = self._start()

    def _start(self) -> Any:
        settings = self._wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True)
        where = None if os.environ.get("WANDB_DIR") else str(self.directory)
        try:
            return self._wandb.init(project=self.project, name=self.run_name, dir=where, settings=settings,
                                    reinit="create_new")
        except Exception as error:  # wandb's own errors (no API key, no network): one line, exit 2
            raise OSError(f"--wandb: W&B did not start ({type(error).__name__}: {str(error).splitlines()[0]})") from None

    def look(self, session: Session, now: float) -> None:
        if now - self._logged_at >= LOG_EVERY_S:
            self._log(session, final=False)
            self._logged_at = now

    def finish(self, session: Session, now: float) -> None:
        """The run's last rows, and its newest segment's figures as the W&B run's summary."""
        self._log(session, final=True)
        if self.run is not None and session is self._session:
            self.run.summary.update(self._segment_values)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    def _log(self, session: Session, final: bool) -> None:
        if session is not self._session:
            if not session.session_id:
                return  # no hello yet
            if self._session is not None:  # a later run: a W&B run of its own
                self.close()
                self.run = self._start()
            self._session, self._rows, self._segment_values = session, ScalarRows(), {}
            self._name_the_run(session)
        if self.run is None:
            return
        for step, row in self._rows.new_rows(session, final):
            self.run.log(row, step=step)
            if segment := {tag: value for tag, value in row.items() if tag.startswith("segment/")}:
                self._segment_values = segment  # the newest segment's alone: a figure it lacks is not an older one's

    def _name_the_run(self, session: Session) -> None:
        hello = next((state.hello for _, state in sorted(session.ranks.items()) if state.hello is not None), None)
        if self.run_name is None:
            self.run.name = session.session_id
        self.run.config.update({"session": session.session_id, "world_size": session.world_size,
                                "strategy": hello.strategy if hello else "", "backend": hello.backend if hello else "",
                                "model_parameters": hello.model_parameters if hello else 0}, allow_val_change=True)
