"""Reading and writing safetensors checkpoints without torch, and placing tensors onto a device mesh.

FLUX.1 and Wan 2.1 checkpoints are 12-28 GB of safetensors, often split over several shard files with a
diffusers ``*.safetensors.index.json``. These modules read them so that no tensor, and never the whole
checkpoint, has to be held in host memory at once:

- ``SafetensorsFile`` (``safetensors_file.py``; the format and its strict checks in
  ``safetensors_header.py``) parses the format itself (8-byte little-endian header length, a JSON header,
  then the raw bytes of every tensor), validates the header strictly, and memory-maps the file. Nothing is
  read until a tensor, or a slice of one, is asked for; a slice along the leading axis touches only its
  rows. bf16 and fp8 stay bf16 and fp8 (``ml_dtypes``), so there is no silent widening and no torch import.
- ``CheckpointFiles`` (``checkpoint_files.py``, with ``open_checkpoint``) is the same interface over
  several shard files, from an index or a plain list.
- ``LazyTensor`` (``lazy_tensor.py``) is a tensor not yet read: a checkpoint entry, or a transpose,
  sub-range or concatenation of others. Converter hooks (qkv split, scale/shift swap, kernel transposes)
  compose these lazily.
- ``place`` (``placement.py``) builds a sharded ``jax.Array`` with ``jax.make_array_from_callback``: each
  device reads only its own box of the tensor straight from the memory map, and a dtype cast happens per
  box, so a bf16 checkpoint loads as fp32 without the full tensor ever existing in fp32 on the host.
- ``write_safetensors`` (``safetensors_write.py``) writes a file atomically (temp file in the same
  directory, fsync, rename), so an interrupted export never leaves a half-written checkpoint under the
  final name.

Format: https://github.com/huggingface/safetensors (README, "Format"). Offsets in ``data_offsets`` are
relative to the first byte after the header. Data is little-endian; like safetensors itself, these modules
assume a little-endian host.

This module is the public face: callers import these names from ``converters.safetensors_io``.
"""

from __future__ import annotations

from converters.checkpoint_files import CheckpointFiles, open_checkpoint
from converters.lazy_tensor import LazyTensor, concatenate, narrow, transpose
from converters.placement import load, place
from converters.safetensors_file import SafetensorsFile
from converters.safetensors_header import TensorInfo
from converters.safetensors_write import write_safetensors

__all__ = [
    "CheckpointFiles",
    "LazyTensor",
    "SafetensorsFile",
    "TensorInfo",
    "concatenate",
    "load",
    "narrow",
    "open_checkpoint",
    "place",
    "transpose",
    "write_safetensors",
]
