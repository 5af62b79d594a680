"""Whether a step compiled, read from torch.compile's own count.

Dynamo counts every graph it compiles (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``,
one for each graph handed to the backend: a compiled model's first call, and a recompile where a
guard failed, such as an input of a new shape or an attribute that changed), and a call served
from its cache adds nothing. So the count moves during a step exactly when that step compiled.
Such a step lasts seconds where its neighbours last milliseconds, so the timeline leaves it out
of the figures and says so (``StepReport.compiling``): a recompile in the middle of a run is a
slowdown worth seeing. (Dynamo's count of frames it met, ``counters["frames"]``, also moves on
frames it only looks at and skips, such as DDP's ``logging`` call when it rebuilds its buckets
in step 2: no compile, so not read here.)
"""

from __future__ import annotations

import sys


def dynamo_graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far; 0 where Dynamo was never imported
    (then nothing here has compiled, and reading costs one dictionary lookup). Never raises: a
    torch whose counters moved gives 0, so no step is called compiling, and training goes on."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        return int(utils.counters["stats"]["unique_graphs"])
    except Exception:
        return 0
