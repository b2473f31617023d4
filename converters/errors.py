"""Errors raised while reading or converting checkpoints.

A converter that meets a damaged file, a missing key or a mis-shaped tensor stops with one of these, and
the message names the file and the tensor, so a user with a 24 GB download can tell which shard to fetch
again instead of reading a stack trace.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointKeyError", "DestinationError"]


class CheckpointError(ValueError):
    """A checkpoint file or index is malformed, or does not hold what it should.

    The message always names the offending file (and the tensor, where there is one).
    """


class CheckpointKeyError(CheckpointError, KeyError):
    """A tensor name asked for is not in the checkpoint.

    Also a KeyError, so mapping-style code (``key in ckpt``, ``except KeyError``) behaves as usual.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0]) if self.args else ""


class DestinationError(CheckpointError):
    """A converted checkpoint cannot be written where it was asked to go: the folder is not writable, a
    parent is a file, the disk is full, or what is there must not be replaced.

    The message names the path and the reason; nothing has been left behind.
    """
