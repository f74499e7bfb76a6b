"""The process-group context of one rank: who we are, and the groups we talk on.

Three groups over the same ranks, so that collectives issued from different places
never interleave on one group in a different order on different ranks:

* ``dense``  - DistributedDataParallel's gradient all-reduce, metric reductions
* ``embed``  - the embedding output all-to-all (forward and backward) and the
               data-parallel tables' gradient all-reduce, issued from autograd
* ``input``  - the input all-to-all of ids, which the train pipeline runs on a
               background thread for the next batch while this one computes

World size 1 is a context with no process group: every collective is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from recscale.launch_env import JobLaunchError, check_rendezvous_env, launch_env


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    dense: dist.ProcessGroup | None = None
    embed: dist.ProcessGroup | None = None
    input: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (one rank: ``obj`` itself)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.dense)
        return box[0]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or launch_env()[0] > 1


def init_distributed(device: torch.device, timeout_s: float = 300.0) -> DistContext:
    """Join the job torchrun (or a test spawner) set up through the environment
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    gloo on CPU, NCCL on CUDA. ``timeout_s`` bounds how long a collective waits for
    a rank that stopped answering, so a dead rank fails the job instead of hanging it.
    """
    world, rank, local_rank = launch_env()
    if world == 1:
        return DistContext(device=device)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {local_rank} needs its own GPU but this machine has "
                f"{torch.cuda.device_count()}: start at most that many ranks per node "
                "(--nproc_per_node), or train on the CPU (--train.device=cpu)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        check_rendezvous_env(world)
        try:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        except dist.DistError as e:  # the store: ranks that never came, an unreachable master
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise JobLaunchError(
                f"rank {rank} of WORLD_SIZE={world} could not form the job at {where} within "
                f"{timeout_s:g} s ({first}): start every rank (torchrun "
                "--nproc_per_node/--nnodes), check MASTER_ADDR and MASTER_PORT, or raise "
                "distributed.timeout_s"
            ) from e
    groups = [dist.new_group(backend=backend, timeout=timeout) for _ in range(3)]
    return DistContext(rank, world, local_rank, device, *groups)


def shutdown(ctx: DistContext) -> None:
    """Destroy the process groups of a job that ended normally.

    A process that exits with its groups alive can abort in the interpreter's teardown
    after its work is done (SIGABRT, "terminate called without an active exception":
    once in CI, a rank of the ssd-tier torchrun test; pytorch/pytorch#190489 reports the
    same of a missing ``destroy_process_group``). Not for a failed rank: a partner may
    still be inside a collective with it, and destroying would wait on that collective."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
