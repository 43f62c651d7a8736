"""A process that builds some of the kernels `fastdpo.model.kernels._launches` lists, then exits:
`python -m fastdpo.model._kernel_builder SPEC PART PARTS` runs the launches whose index is PART modulo PARTS.

Triton holds Python's GIL through most of a build, so builds on a thread of the training process slow its imports
and tokenising. Built here, on other cores, they land in Triton's on-disk cache, and the training process's own
build pass then only loads them. Prints each launch it ran, one per line; exits 1 (with the error on stderr) when a
launch fails, which only means the training process builds that kernel itself."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import torch

    from fastdpo.model import kernels

    spec, part, parts = json.loads(argv[0]), int(argv[1]), int(argv[2])
    device = torch.device(spec["device"])
    launches = kernels._launches(spec["widths"], getattr(torch, spec["dtype"]), device, spec["head_dim"], spec["lora"])
    for i, launch in enumerate(launches):
        if i % parts == part:
            launch()
            print(i, kernels.launch_name(launch), flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
