"""A rank whose DeepSpeed ``load_checkpoint`` raised inside DeepSpeed's own load (after fastckpt's
pre-read and agreement, ``preread.py``: a user's ``custom_load_fn``, DeepSpeed's optimizer load
finding a file's contents wrong, a read DeepSpeed makes itself) runs the collectives the other
ranks still run in theirs, then joins the agreement after the load (``agree.agree_on_load``),
which pairs with theirs: every rank learns of the failure and raises. Left out, the other ranks
waited for ever in DeepSpeed's next collective while the failed rank waited in the agreement.
The save's counterpart is ``FastCkptEngine.abandon``.

The collectives of DeepSpeed's load body (0.19), in order, on every rank:
  ZeRO-3, weights only (``fp32.applies``): after its consolidation of every rank's files, a gather
      of the module's parameters (``GatheredParameters(..., modifier_rank=0)``; its exit, which
      broadcasts and partitions, runs also when the module load inside it raised)
  ZeRO-3: at the end, the gather of the persistent parameters (``checkpoint_event_epilogue``)
ZeRO 0-2 run none between their file reads and the end of the load: the agreement pairs already.
Not covered (a rank that raises there still waits until the process group's timeout):
``pipeline_loading_checkpoint``'s send/recv chain, MoE expert loads, universal checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import fp32


class LoadRejoin:
    """Tracks how far this rank's DeepSpeed load came (``watch``), and runs what it skipped
    (``rejoin``), on the training thread that called ``load_checkpoint``.

    Args:
        engine: the DeepSpeedEngine.
        consolidates: the load takes ZeRO-3's weights-only route (``fp32.applies``).
    """

    def __init__(self, engine: object, consolidates: bool) -> None:
        self.engine, self.consolidates = engine, consolidates
        self.epilogue_began = False

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """While DeepSpeed's load runs: its optimizer's ``checkpoint_event_epilogue`` (public,
        wrapped on the instance only for the load) records that the last collective began."""
        opt = getattr(self.engine, "optimizer", None)
        if opt is None or not hasattr(opt, "checkpoint_event_epilogue"):
            yield
            return
        own = opt.__dict__.get("checkpoint_event_epilogue")  # an instance attribute of someone else's, or None
        inner = opt.checkpoint_event_epilogue

        def checkpoint_event_epilogue() -> object:
            self.epilogue_began = True
            return inner()

        opt.checkpoint_event_epilogue = checkpoint_event_epilogue
        try:
            yield
        finally:
            if own is None:
                del opt.checkpoint_event_epilogue
            else:
                opt.checkpoint_event_epilogue = own

    def rejoin(self) -> None:
        """DeepSpeed's load raised on this rank: run the collectives the other ranks run after the
        point where it raised (see the module docstring); nothing once the epilogue began."""
        if self.epilogue_began:
            return
        e = self.engine
        if self.consolidates and not fp32.consolidated():  # raised before the gather of the weights
            import deepspeed
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            params = [p for p in e.module.parameters()  # type: ignore[attr-defined]
                      if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                pass
        opt = getattr(e, "optimizer", None)
        if opt is not None and hasattr(opt, "checkpoint_event_epilogue"):
            opt.checkpoint_event_epilogue()
