"""Checks of a generation's inputs and output that need no model: run before anything loads or computes.

A request that fails after the weights are read (tens of GB for FLUX or Wan, minutes of compile) or after
the pictures are made (the whole generation) throws that work away. What can be told from the files and
strings alone is told here, first:

- prompts are text a tokenizer takes: a command line's undecodable bytes arrive in Python as lone
  surrogates (PEP 383), which tokenizers reject deep inside with an unrelated error; control characters
  (an escape sequence pasted from a terminal, a binary file's bytes) other than tab and newline are read
  as unknown tokens, so the picture would follow something other than the words typed;
- the output path can be written: not a folder, every name on it fits the file system (the picture is
  not lost to "File name too long" after the run), its nearest existing ancestor is a folder in which a
  temporary file can be created (and is removed at once); missing folders are created only when the
  result is written, so a failed run leaves none behind;
- an embeddings file (``--prompt_embeds``, .npz or .safetensors) opens, holds floating-point arrays, and
  every value is finite;
- a first-frame picture (``--image``) is a picture Pillow can read.
"""

from __future__ import annotations

import os
import tempfile
import unicodedata
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from converters.errors import CheckpointError
from converters.safetensors_io import open_checkpoint
from jaxdit.pipelines import finite

__all__ = ["check_image_file", "check_prompts", "check_writable", "read_embeddings"]


def check_prompts(prompts: Sequence[str], what: str = "prompt") -> None:
    """Raise ValueError unless every prompt encodes as UTF-8 and holds no control character but tab,
    newline and carriage return (names the prompt, position and character)."""
    for number, prompt in enumerate(prompts, 1):
        which = f"{what} {number}" if len(prompts) > 1 else what
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            char = prompt[e.start]
            byte = f" (the byte 0x{ord(char) - 0xDC00:02x})" if 0xDC80 <= ord(char) <= 0xDCFF else ""
            raise ValueError(
                f"{which} is not valid UTF-8 text: character {e.start} is {char!r}{byte}, which no "
                "tokenizer reads; pass the prompt as UTF-8"
            ) from None
        for position, char in enumerate(prompt):
            if char not in "\t\n\r" and unicodedata.category(char) == "Cc":
                raise ValueError(
                    f"{which} holds the control character U+{ord(char):04X} at character {position}, which "
                    "the tokenizers read as an unknown token; remove it (tabs and newlines are fine)"
                )


def check_writable(path: str | os.PathLike[str], flag: str = "--output") -> None:
    """Raise ValueError unless a file can be written at ``path``: not an existing folder, every name on it
    within the file system's length limit, and its nearest existing ancestor is a folder where a
    temporary file can be created (it is removed again)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise ValueError(f"{flag} {path} is a folder; give a file name inside it")
        ancestor = path.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
    except OSError as e:  # a name too long, a symbolic link loop on the way
        shown = str(path) if len(str(path)) <= 100 else f"{str(path)[:60]}...{str(path)[-20:]}"
        raise ValueError(f"{flag} {shown}: {e.strerror or e}") from None
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path}: {ancestor} is a file, so no folder can be made there")
    try:
        longest = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    missing = path.parts[len(ancestor.parts) :]  # the folders still to be made, and the file
    for depth, name in enumerate(missing, 1):
        if len(os.fsencode(name)) > longest:
            raise ValueError(
                f"{flag}: the name {name[:24]}... is {len(os.fsencode(name))} bytes; {ancestor} "
                f"takes names of at most {longest}"
            )
        folder = ancestor.joinpath(*missing[:depth])
        if depth < len(missing) and os.path.lexists(folder):  # there, yet not found: a broken link
            raise ValueError(
                f"{flag} {path}: {folder} is a symbolic link to nothing (a loop or a missing target), so "
                "no folder can be made there"
            )
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxdit-write-test-", dir=ancestor)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {ancestor} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def read_embeddings(path: str | os.PathLike[str], flag: str = "--prompt_embeds") -> dict[str, np.ndarray]:
    """The arrays of a .npz or .safetensors embeddings file, or a ValueError naming what is wrong with it
    (missing, unreadable, not arrays of floating-point numbers, NaN or inf in one)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".safetensors"):
        raise ValueError(f"{flag} {path}: expected a .npz or .safetensors file")
    try:
        arrays = _read_npz(path) if suffix == ".npz" else _read_safetensors(path)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{flag} {path} cannot be read as {suffix[1:]}: {e}") from None
    if not arrays:
        raise ValueError(f"{flag} {path} holds no arrays")
    for name, a in arrays.items():
        if a.dtype.kind != "f" and not (a.dtype.kind == "V" and a.dtype.itemsize in (1, 2)):
            raise ValueError(f"{flag} {path}: {name} is {a.dtype}; embeddings are floating-point arrays")
    finite.check_arrays("embeddings", {f"{flag} {path}: {k}": v for k, v in arrays.items()}, given=True)
    return arrays


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    archive = np.load(path, allow_pickle=False)
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError("it holds one array, not a .npz archive of named arrays")
    with archive:
        return {k: archive[k] for k in archive.files}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        ckpt = open_checkpoint(path)
        return {k: ckpt.read(k) for k in ckpt}
    except CheckpointError as e:
        raise ValueError(str(e)) from None


def check_image_file(path: str | os.PathLike[str], flag: str = "--image") -> None:
    """Raise ValueError unless ``path`` is a picture Pillow can read (header and data)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        with Image.open(path) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError) as e:
        raise ValueError(f"{flag} {path} is not a picture Pillow can read ({e})") from None
