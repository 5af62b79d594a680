"""``torchrun train.py …`` from a clone. The script is ``instrumented_ddp/training/train.py``: it is packaged so
that an installed ddpwatch runs it too (``torchrun -m instrumented_ddp.training.train …``, as ``ddpwatch demo``
and ``ddpwatch doctor`` do), where a clone's top-level script would be missing."""

from instrumented_ddp.distributed import exit_process
from instrumented_ddp.training.train import main

if __name__ == "__main__":
    exit_process(main())  # see exit_process: skips a gloo teardown race at interpreter exit
