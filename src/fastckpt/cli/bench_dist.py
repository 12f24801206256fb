"""bench's nodes: torch.distributed under torchrun (``$WORLD_SIZE`` > 1), else a single node."""

from __future__ import annotations

import datetime
import os

import click

from ..config import env_count
from ..errors import ConfigError

RENDEZVOUS_ENV = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torch's env:// rendezvous reads beside WORLD_SIZE
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


class Dist:
    """The process group of a bench over several nodes, or a single node's stand-in.

    Raises:
        ConfigError: ``$WORLD_SIZE``, ``$LOCAL_RANK`` or ``$RANK`` is no count in range, or a
            ``$WORLD_SIZE`` > 1 comes without the other variables of the rendezvous.
    """

    def __init__(self) -> None:
        fix = "run bench without a launcher (one node)"  # a bare int() was a ValueError traceback
        self.world = env_count("WORLD_SIZE", 1, 1, meaning=" (the number of processes)", fix=fix)
        self.local_rank = env_count("LOCAL_RANK", 0, 0, meaning=" (this process's index on its node)", fix=fix)
        self._dist = None
        self.rank = 0
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                self._rendezvous(dist)
            self._dist, self.rank = dist, dist.get_rank()

    def _rendezvous(self, dist) -> None:  # noqa: ANN001 (torch.distributed)
        """Check what env:// needs before torch reads it (its ValueError was a traceback), and say
        what the wait is for: a node whose peers never start waits here for ``GROUP_TIMEOUT``."""
        missing = [f"${v}" for v in RENDEZVOUS_ENV if not os.environ.get(v, "").strip()]
        if missing:
            names = " and ".join(filter(None, (", ".join(missing[:-1]), missing[-1])))
            raise ConfigError(f"$WORLD_SIZE={self.world} in the environment makes bench one of {self.world} nodes, "
                              f"but {names} {'is' if len(missing) == 1 else 'are'} not set (torch's "
                              "rendezvous needs $RANK, $MASTER_ADDR and $MASTER_PORT too): run bench under torchrun, "
                              "which sets them all (docs/readiness.md), or unset WORLD_SIZE to bench this node alone")
        rank = env_count("RANK", 0, 0, self.world - 1, meaning=f" (this node's rank among $WORLD_SIZE={self.world})",
                         fix="unset WORLD_SIZE to bench this node alone")
        where = f"{os.environ['MASTER_ADDR'].strip()}:{os.environ['MASTER_PORT'].strip()}"
        click.echo(f"fastckpt bench: rank {rank} waiting for {self.world} nodes at {where} (every node must start "
                   f"bench; the wait ends after {GROUP_TIMEOUT.total_seconds() / 60:.0f} minutes)", err=True)
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)

    def barrier(self) -> None:
        if self._dist is not None:
            self._dist.barrier()

    def gather(self, obj: object) -> list:
        if self._dist is None:
            return [obj]
        out: list = [None] * self.world
        self._dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()
