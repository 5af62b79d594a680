"""``torchrun -m instrumented_ddp.train …``: the built-in training script (``training/train.py``)."""

from instrumented_ddp.distributed import exit_process
from instrumented_ddp.training.train import main

if __name__ == "__main__":
    exit_process(main())  # see exit_process: skips a gloo teardown race at interpreter exit
