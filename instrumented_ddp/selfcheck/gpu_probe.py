"""What ``ddpwatch doctor`` needs to know from torch, measured in a process of its own.

    python -m instrumented_ddp.selfcheck.gpu_probe            # one JSON object on stdout

``ddpwatch`` never imports torch, so the doctor runs this and reads its answer: the CUDA
devices torch sees (name, UUID, PCI bus id), NVML's readings of device 0 taken by the very
reader a rank's sampler uses, while this process keeps that GPU busy (so a reader looking at
the wrong GPU reads an idle one), and how many times a watched training step made the host
wait for the device, counted by ``torch.cuda.set_sync_debug_mode("warn")`` over watched steps
of the tiny model on a one-rank NCCL group. On a machine without CUDA it says only that.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any

SAMPLES = 6
WATCHED_STEPS = 8


def devices(torch: Any) -> list[dict[str, Any]]:
    from instrumented_ddp.resources.device_sampler import cuda_device_identity

    found = []
    for index in range(torch.cuda.device_count()):
        identity = cuda_device_identity(torch, index)
        properties = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": properties.name, "uuid": identity.uuid, "pci_bus_id": identity.pci_bus_id,
                      "memory_bytes": int(properties.total_memory)})
    return found


def nvml_under_load(torch: Any) -> dict[str, Any]:
    """Samples of device 0 through the rank's own reader while matrix products keep it busy."""
    from instrumented_ddp.resources.device_sampler import cuda_device_identity, make_reader

    reader, note = make_reader("cuda", cuda_device_identity(torch, 0))
    if note:
        return {"note": note, "samples": []}
    a = torch.randn(4096, 4096, device="cuda:0")
    samples = []
    for _ in range(SAMPLES):
        deadline = time.monotonic() + 0.25
        while time.monotonic() < deadline:
            a = (a @ a).tanh_()  # keeps the GPU busy; tanh keeps the values finite
        samples.append(reader.read())
    torch.cuda.synchronize()
    return {"note": "", "samples": samples}


def syncs_in_watched_steps(torch: Any) -> dict[str, Any]:
    """Device synchronisations per watched step (``bucket`` on the tiny model, one NCCL rank),
    as torch's sync debug mode counts them: it warns on every call that makes the host wait."""
    import torch.distributed as dist

    import instrumented_ddp
    from instrumented_ddp.distributed import DistributedContext
    from instrumented_ddp.training.models import build_tiny_model
    from instrumented_ddp.publish.watch import Watch

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        context = DistributedContext(0, 1, 0, torch.device("cuda:0"), "nccl")
        watch = Watch.start("tcp://127.0.0.1:9", context, {"strategy": "bucket", "settings": {}, "model_parameters": 0})
        model = instrumented_ddp.wrap(build_tiny_model(vocab_size=256, num_labels=5).cuda(), "bucket", bucket_mb=1.0,
                                      timeline=watch.timeline)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = {"input_ids": torch.randint(1, 256, (8, 64)).pin_memory(), "labels": torch.randint(0, 5, (8,)).pin_memory()}
        counted: list[str] = []
        for step in range(1, WATCHED_STEPS + 3):
            measuring = step > 2  # the first steps allocate, build caches, warm up NCCL
            torch.cuda.set_sync_debug_mode("warn" if measuring else "default")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                watch.agree_on_command()
                watch.timeline.begin_step(step, model.name, model.settings)
                with watch.timeline.phase("data"):
                    on_device = {k: v.to("cuda:0", non_blocking=True) for k, v in batch.items()}
                loss = model(**on_device).loss
                with watch.timeline.phase("backward"):
                    loss.backward()
                model.finish_gradient_sync()
                with watch.timeline.phase("optimizer"):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=False)
                watch.timeline.end_step(8, 8 * 64, loss.detach())
                watch.step_done()
            torch.cuda.set_sync_debug_mode("default")
            if measuring:
                counted += [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
        torch.cuda.synchronize()
        watch.close()
        instrumented_ddp.unwrap(model)
        return {"steps": WATCHED_STEPS, "syncs": len(counted), "examples": sorted(set(counted))[:5]}
    finally:
        dist.destroy_process_group()


def probe() -> dict[str, Any]:
    import torch

    answer: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if not answer["cuda_available"]:
        return answer
    answer["cuda"] = torch.version.cuda
    answer["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    answer["devices"] = devices(torch)
    answer["nvml"] = nvml_under_load(torch)
    answer["sync_check"] = syncs_in_watched_steps(torch)
    return answer


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print(json.dumps(probe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
