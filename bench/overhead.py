"""What watching costs, from a clone: ``python bench/overhead.py [--device cuda --ranks 1 ...]``.

The bench is ``instrumented_ddp/selfcheck/overhead_bench.py`` (its docstring says what it measures and
how), a module of the package so that ``ddpwatch doctor`` runs it from an installed ddpwatch too
(``python -m instrumented_ddp.selfcheck.overhead_bench``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from instrumented_ddp.selfcheck.overhead_bench import main  # noqa: E402 (the repository is on the path only now)

if __name__ == "__main__":
    main()
