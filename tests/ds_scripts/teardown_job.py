"""A gloo job of N ranks that gathers once, then ends as ENDING says inside coat_ds.launch.teardown.torn_down
(or, `bare`, without it: the control). Used by tests/launched/test_teardown.py."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from coat_ds.launch.teardown import torn_down


def _raise() -> None:
    raise ValueError(f"boom on rank {dist.get_rank()}")


ENDINGS = {
    "return": lambda: None,
    "exit1": lambda: sys.exit(1),
    "message": lambda: sys.exit(f"error: rank {dist.get_rank()} refused"),   # each rank's line its own
    "raise": _raise,
}


def main() -> None:
    ending = sys.argv[-1]
    dist.init_process_group("gloo")
    outs = [torch.empty(1) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, torch.tensor([float(dist.get_rank())]))
    for _ in range(8):   # work gloo's threads still hold at the exit: what makes a bare exit abort
        dist.all_reduce(torch.ones(1 << 16), async_op=True)
    if ending == "bare":
        sys.exit(1)
    with torn_down():
        ENDINGS[ending]()
    print(f"rank {dist.get_rank() if dist.is_initialized() else '-'}: group destroyed", flush=True)


if __name__ == "__main__":
    main()
