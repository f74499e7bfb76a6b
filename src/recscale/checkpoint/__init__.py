"""Checkpoints: atomic, verified, full or incremental, optionally quantized, asynchronous."""

from recscale.checkpoint.format import CheckpointError, verify
from recscale.checkpoint.manager import CheckpointManager, resolve_chain

__all__ = ["CheckpointError", "CheckpointManager", "resolve_chain", "verify"]
