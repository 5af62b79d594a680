"""``python -m ddpwatch …``: the same as the ``ddpwatch`` command (where no script is on PATH)."""

from ddpwatch.cli import main

raise SystemExit(main())
