"""The ``jaxdit`` command: a thin dispatcher over the library, one function per subcommand.

jaxdit convert SRC DST [--dtype bfloat16]   checkpoint (BFL, diffusers, original Wan) -> jaxdit orbax folder
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

DTYPES = ("float32", "bfloat16", "float16")


def _convert(args: argparse.Namespace) -> int:
    from jaxdit.loading import convert_checkpoint

    out = convert_checkpoint(args.src, args.dst, args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxdit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser(
        "convert",
        help="convert a checkpoint (FLUX BFL file, diffusers folder, original Wan 2.1 folder) into a jaxdit orbax "
        "folder, atomically",
    )
    convert.add_argument(
        "src", help="a .safetensors file, a diffusers model or pipeline folder, an original Wan 2.1 folder"
    )
    convert.add_argument("dst", help="the folder to write (must not exist unless --overwrite)")
    convert.add_argument("--dtype", choices=DTYPES, default=None, help="default: the checkpoint's dtype")
    convert.add_argument("--overwrite", action="store_true", help="replace DST once the new one is complete")
    convert.set_defaults(func=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from converters.errors import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, FileExistsError) as e:
        print(f"jaxdit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
