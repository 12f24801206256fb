"""The start of a one-process Megatron child script (``python -c PREAMBLE + BODY CK_DIR``): it
owns its process group (gloo, a FileStore beside ``ck_dir``) and registers a Checkpointer as
Megatron's strategy (``ck``, ``dc``, ``fm`` and the sharded types are defined for the body)."""

PREAMBLE = r"""
import fractions, os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
import fastckpt
from fastckpt.integrations import megatron as fm

ck_dir = sys.argv[1]
dist.init_process_group("gloo", store=dist.FileStore(ck_dir + ".store", 1), rank=0, world_size=1)
ck = fastckpt.Checkpointer()
fm.register(ck)
"""
