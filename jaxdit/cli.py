"""The ``jaxdit`` command: a thin dispatcher over the library, one function per subcommand.

jaxdit generate [--model tiny-digits] [--prompt ...] [parallel flags]   sample images on a mesh
jaxdit generate --model wan2.1-t2v-1.3b --weights DIR --prompt_embeds FILE [--num_frames 81]   video latents
jaxdit convert SRC DST [--dtype bfloat16]   checkpoint (BFL, diffusers, original Wan) -> jaxdit orbax folder
jaxdit plan --model flux-dev --devices 8 [--link nvlink] [--json] [--verify]   every parallel configuration
jaxdit serve [--weights DIR] [parallel flags] [--sizes 1024x1024] --port 8000   HTTP service, model kept compiled

Parallel flags are named as xDiT names them (``--ulysses_degree``, ``--use_cfg_parallel``, ...); the
hyphenated spellings work too. Every combination is checked before anything is loaded or compiled.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxdit.cli_family_flags import FamilyHelp, parse_family_flags
from jaxdit.cli_help import RegistryHelp

DTYPES = ("float32", "bfloat16", "float16")
#: jaxdit.parallel.kernels.CHOICES, spelled out so that parsing flags does not import jax.
ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "triton", "splash")


def _convert(args: argparse.Namespace) -> int:
    from jaxdit.families import convert_checkpoint
    from jaxdit.lora import parse_lora

    loras = [parse_lora(arg) for arg in args.lora or ()]
    try:
        out = convert_checkpoint(
            args.src, args.dst, args.dtype, overwrite=args.overwrite, loras=loras, fp8=args.quantize == "fp8"
        )
    except OSError as e:  # reading the source (FileExistsError is the caller's: DST exists)
        if isinstance(e, FileExistsError):
            raise
        print(f"jaxdit convert: error: {e.filename or args.src}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxdit convert: interrupted; {args.dst} was not written", file=sys.stderr)
        return 130
    print(f"wrote {out}")
    return 0


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--name_with_underscores`` and its ``--hyphenated-spelling``."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, dest=name, **kwargs)


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate images with a model on a (possibly emulated) device mesh",
        formatter_class=RegistryHelp,
        add_help=False,
    )
    gen.add_argument("-h", "--help", action=FamilyHelp, help="show this help message and exit")
    _flag(
        gen,
        "model",
        default=None,
        help="{bundled} (bundled; the first is the default without --weights) or, with --weights, one of "
        "{presets} (optional with a pipeline folder: the folder says what it is)",
    )
    _flag(
        gen,
        "weights",
        default=None,
        help="a downloaded pipeline folder (diffusers FluxPipeline/WanPipeline, or Wan's original release: "
        "prompt to pixels, --model optional), or a transformer checkpoint: BFL file, diffusers folder or "
        "jaxdit orbax folder (then --prompt_embeds)",
    )
    _flag(
        gen,
        "prompt",
        default=None,
        action="append",
        help="the text prompt (pipeline folders); repeat it for one picture per prompt in one run, written "
        "as a grid (families whose pipeline takes a batch: Z-Image); tiny-digits: the digits to draw, e.g. "
        "0123456789 (default)",
    )
    _flag(gen, "negative_prompt", default=None, help="negative prompt for true CFG (tiny-digits: '' = empty)")
    _flag(
        gen,
        "prompt_embeds",
        default=None,
        help=".npz/.safetensors with prompt_embeds, pooled_prompt_embeds "
        "(and negative_prompt_embeds, negative_pooled_prompt_embeds), for models without a text encoder yet; "
        "Wan: prompt_embeds, negative_prompt_embeds (I2V also image_embeds, condition)",
    )
    _flag(
        gen,
        "height",
        type=int,
        default=None,
        help="pixels (default: the model's: 16 for tiny-digits, 1024 for FLUX, 480 for Wan)",
    )
    _flag(gen, "width", type=int, default=None, help="pixels (default: as --height; 832 for Wan)")
    _flag(gen, "num_frames", type=int, default=None, help="Wan: video frames, 4n + 1 (default 81)")
    _flag(
        gen,
        "image",
        default=None,
        action="append",
        help="a picture file: Wan I2V / TI2V's first frame (TI2V without it: text only), FLUX.1 Kontext's "
        "reference image to edit (pipeline folders); FLUX.2 takes several (repeat --image)",
    )
    _flag(
        gen,
        "max_sequence_length",
        type=int,
        default=None,
        help="pipeline folders: text-encoder tokens (default 512, as diffusers)",
    )
    _flag(
        gen,
        "flow_shift",
        type=float,
        default=None,
        help="Wan: UniPC sigma shift (default 5.0 at 720p, else 3.0)",
    )
    _flag(gen, "num_inference_steps", type=int, default=None, help="alias --steps")
    gen.add_argument("--steps", dest="num_inference_steps", type=int, help=argparse.SUPPRESS)
    _flag(
        gen,
        "guidance_scale",
        type=float,
        default=None,
        help="FLUX-dev: embedded guidance (default 3.5); Wan: classifier-free guidance scale (default 5.0); "
        "alias --guidance",
    )
    gen.add_argument("--guidance", dest="guidance_scale", type=float, help=argparse.SUPPRESS)
    _flag(
        gen,
        "guidance_scale_2",
        type=float,
        default=None,
        help="Wan 2.2 A14B: the low-noise expert's guidance scale (default: --guidance_scale)",
    )
    _flag(
        gen,
        "offload_idle_expert",
        action="store_true",
        help="Wan 2.2 A14B: keep only the running expert on the devices, the idle one in host memory",
    )
    _flag(
        gen,
        "true_cfg_scale",
        type=float,
        default=None,
        help="classifier-free guidance scale (needs a negative)",
    )
    _flag(gen, "seed", type=int, default=0)
    _flag(
        gen,
        "output",
        default=None,
        help="output file: .png (images), .mp4 or .gif (videos), .npy (latents)",
    )
    _flag(gen, "emulate_devices", type=int, default=None, help="emulate N CPU devices (sets XLA flags)")
    _flag(
        gen,
        "compare_single_device",
        action="store_true",
        help="also run on one device and print the max difference",
    )
    _flag(gen, "dtype", choices=DTYPES, default=None)
    _flag(
        gen,
        "attention_backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="per-device attention kernel (default auto: cuDNN on NVIDIA GPUs for bf16/fp16, splash on TPUs, "
        "XLA otherwise); one that cannot serve falls back with a warning",
    )
    _flag(
        gen,
        "quantize",
        choices=("fp8",),
        default=None,
        help="fp8: the transformer blocks' linear weights in float8_e4m3fn with per-channel scales (half the "
        "memory of bfloat16); embedders, modulation, norms, attention and the sampler stay as --dtype",
    )
    _flag(
        gen,
        "fp8_mode",
        choices=("weight", "matmul"),
        default=None,
        help="with --quantize fp8: weight (weights dequantized into bf16/fp32 matmuls) or matmul (FP8 "
        "matmuls with per-token activation scales; GPUs of compute capability 8.9+, emulated on CPU). "
        "Default: matmul where every GPU has FP8, else weight",
    )
    _flag(
        gen,
        "fp8_skip_steps",
        type=int,
        default=0,
        metavar="N",
        help="with --quantize fp8: run the first N and the last N steps with the original (--dtype) weights, "
        "kept on the devices beside the FP8 ones (more weight memory than bf16 alone: FLUX.1-dev 30.2 GiB "
        "against 22.2). Default 0, as "
        "xDiT's, whose FP8 GEMMs run every step",
    )
    _flag(
        gen,
        "fp8_keep",
        default=None,
        metavar="LAYERS",
        help="with --quantize fp8: the block layers left in --dtype, as comma-separated path parts (e.g. "
        "img_mlp,txt_mlp), replacing the family's own list (Qwen-Image: img_mlp); none: quantize them all",
    )
    _flag(
        gen,
        "fsdp",
        action="store_true",
        help="shard every transformer block's weights over the mesh's devices (all axes but cfg and data) "
        "and all-gather each layer just before it runs, the next layer's gather overlapping this one's "
        "compute: 1/P of the block weights per device, the same result bit for bit",
    )
    _flag(
        gen,
        "offload_encoders",
        action="store_true",
        help="pipeline folders: keep the text (and image) encoders' weights in host memory between prompts, "
        "copied to the device for each encode, so the transformer gets the device's memory",
    )
    _flag(
        gen,
        "encoder_on_mesh",
        action="store_true",
        help="pipeline folders whose builder takes it (FLUX.2): shard the text encoder over the transformer's "
        "mesh (heads and MLP over --tensor_parallel_degree, the prompt's tokens over the sequence axes) "
        "instead of running it on the first device",
    )
    _flag(
        gen,
        "lora",
        action="append",
        default=None,
        metavar="FILE[:SCALE]",
        help="a LoRA file (.safetensors: kohya, BFL/ComfyUI, diffusers/PEFT, XLabs, musubi layouts), fused "
        "into the weights on the mesh; repeatable, each with its own scale (default 1). Wan 2.2 A14B: into "
        "the high-noise expert (diffusers' transformer)",
    )
    _flag(
        gen,
        "lora_2",
        action="append",
        default=None,
        metavar="FILE[:SCALE]",
        help="Wan 2.2 A14B: a LoRA file fused into the low-noise expert (diffusers' transformer_2, as "
        "load_lora_weights(..., load_into_transformer_2=True)); repeatable",
    )
    _flag(gen, "verbose", action="store_true", help="print the XLA flags and compilation cache jaxdit set up")
    gen.add_argument("-v", dest="verbose", action="store_true", help=argparse.SUPPRESS)
    _flag(
        gen,
        "compilation_cache_dir",
        default=None,
        help="keep compiled programs here (default: $JAXDIT_COMPILATION_CACHE, else ~/.cache/jaxdit/xla)",
    )
    _flag(gen, "no_compilation_cache", action="store_true", help="compile everything afresh, keep nothing")
    par = gen.add_argument_group("parallelism (xDiT's flags)")
    _flag(par, "data_parallel_degree", type=int, default=1)
    _flag(par, "use_cfg_parallel", action="store_true", help="split the CFG branches over 2 devices")
    _flag(par, "ulysses_degree", type=int, default=1)
    _flag(par, "ring_degree", type=int, default=1)
    _flag(par, "tensor_parallel_degree", type=int, default=1)
    _flag(par, "pipefusion_parallel_degree", type=int, default=1, help="PipeFusion stages (FLUX, Wan)")
    _flag(
        par,
        "num_pipeline_patch",
        type=int,
        default=None,
        help="PipeFusion patches M >= P, whole rows of the latent (default: FLUX 2P if it divides them, else P; "
        "Wan the smallest M >= P that divides the rows)",
    )
    _flag(
        par, "warmup_steps", type=int, default=None, help="PipeFusion's synchronous first steps (default 1)"
    )
    cache = gen.add_argument_group(
        "feature cache (skip the transformer's blocks on steps that change little)"
    )
    _flag(
        cache,
        "use_fbcache",
        action="store_true",
        help="First-Block-Cache: block 0 runs every step; the others are skipped while its residual changes "
        "less than --cache_threshold (relative L1)",
    )
    _flag(
        cache,
        "use_teacache",
        action="store_true",
        help="TeaCache: every block is skipped while the accumulated, rescaled change of the step's input "
        "stays below --cache_threshold",
    )
    _flag(
        cache,
        "cache_threshold",
        type=float,
        default=None,
        help="default: First-Block-Cache 0.08 (tiny-digits 0.2); TeaCache the model's published one "
        "(FLUX.1 0.4; Wan 2.1 1.3B 0.08, 14B 0.2, I2V 480P 0.26 / 720P 0.3); MagCache the shipped one; "
        "DBCache 0.08",
    )
    from jaxdit.generate_cache import add_arguments as add_cache_flags

    add_cache_flags(cache, _flag)
    from jaxdit.distributed import add_arguments as add_process_flags

    add_process_flags(gen)
    gen.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from jaxdit import runtime
    from jaxdit.generate import GenerateRequest, check_request, run

    request = GenerateRequest.from_args(args)
    check_request(request)  # every flag combination, before jax starts or anything loads
    setup = runtime.configure(
        cache_dir=args.compilation_cache_dir,
        no_cache=args.no_compilation_cache,
        gpu=False if request.emulate_devices else None,  # emulated devices run on the CPU
        count_cache=args.verbose,
    )
    if args.verbose:
        print("\n".join(setup.describe()))
    code = run(request)
    if setup.counter is not None:
        print(setup.counter.describe())
    return code


def _add_plan(sub) -> None:
    from jaxdit.plan.command import add_arguments

    plan = sub.add_parser(
        "plan",
        help="model every parallel configuration's communication, memory and latency; --verify compiles them",
        formatter_class=RegistryHelp,
    )
    add_arguments(plan)
    plan.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from jaxdit.plan.command import run

    return run(args)


def _add_serve(sub) -> None:
    from jaxdit.serve.command import add_arguments

    serve = sub.add_parser(
        "serve",
        help="an HTTP service (OpenAI-shaped images and video jobs) that keeps the model loaded and compiled",
        formatter_class=RegistryHelp,
    )
    add_arguments(serve)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from jaxdit.serve.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxdit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)

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
    convert.add_argument(
        "--quantize",
        choices=("fp8",),
        default=None,
        help="write the transformer blocks' linear weights as float8_e4m3fn with per-channel scales (after "
        "any --lora is fused); generate then loads them as they are, half the memory of bfloat16",
    )
    convert.add_argument(
        "--lora",
        action="append",
        metavar="FILE[:SCALE]",
        help="fuse this LoRA into the written checkpoint (repeatable, each with its own scale)",
    )
    convert.set_defaults(func=_convert)
    _add_plan(sub)
    _add_serve(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # a family's own flags (jaxdit generate), else what parse_args would refuse
        if args.command != "generate":
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        args.family_flags = parse_family_flags(extras, parser.error)
    from converters.errors import CheckpointError
    from jaxdit.distributed import StartupError

    try:
        return args.func(args)
    except (CheckpointError, FileExistsError, ValueError, StartupError) as e:
        print(f"jaxdit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
