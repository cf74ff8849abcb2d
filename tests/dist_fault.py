"""A 2-process job where rank 1 stops answering (tests/test_dist_faults.py).

    torchrun --nproc_per_node 2 tests/dist_fault.py MODE TIMEOUT

MODE "sleep": rank 1 sleeps instead of joining the next collective; "stop": rank 1 stops itself
with SIGSTOP; "raw": rank 1 sleeps and rank 0 waits in a bare torch collective (as FSDP's are),
whose error is turned into the line as train.py's main() does. Every rank prints "waiting <unix
time>" first; rank 0 must then exit 1 within TIMEOUT seconds, saying "error: rank 1 stopped
answering ...". MODE "exit": rank 1 exits instead, and rank 0 says "error: rank 1 exited
during a collective ...". MODE "slow_main": rank 0 works for TIMEOUT + 3 s, the others wait in
faults.wait_for_main; all print "world 2". MODE "launch": print "world <N>" after
distributed.init(), or its error."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer import distributed, faults  # noqa: E402
from trainer.config import ConfigError  # noqa: E402


def main() -> None:
    mode, timeout = sys.argv[1], float(sys.argv[2])
    if mode == "launch":
        try:
            print(f"world {distributed.init()[1]}", flush=True)
        except ConfigError as e:
            sys.exit(f"error: {e}")
        return
    from trainer.config import TrainingFault

    rank, world, _ = distributed.init(timeout)
    assert distributed.gather_lists([rank], world) == list(range(world))  # the group works
    if mode == "slow_main":  # rank 0 builds something for longer than the timeout; the others wait for it
        if rank == 0:
            time.sleep(timeout + 3)
        faults.wait_for_main(world, "build")
        print(f"world {len(distributed.gather_lists([rank], world))}", flush=True)
        distributed.close(world)  # as train.py does: without it gloo sometimes aborts at exit
        return
    distributed.barrier(world)
    print(f"waiting {time.time()}", flush=True)
    if rank == 1:
        if mode == "exit":
            os._exit(3)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    try:
        if mode == "raw":
            try:
                dist.all_reduce(torch.ones(1))
            except RuntimeError as e:
                raise faults.stopped_answering(e) or e from None
        else:
            distributed.gather_lists([rank], world)
    except TrainingFault as e:
        sys.exit(f"error: {e}")
    sys.exit("error: the collective returned")


if __name__ == "__main__":
    main()
