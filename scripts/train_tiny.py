"""Train the bundled ``tiny-digits`` model: FLUX architecture, flow matching, scikit-learn's digits.

    python scripts/train_tiny.py [--steps 4000] [--out jaxdit/assets/tiny-digits]

Rectified-flow training (x_s = (1 - s) x0 + s e, target v = e - x0, s logit-normal as in SD3) with
optax AdamW, label dropout to the empty prompt (10%) so classifier-free guidance works. Seeded: the same
command gives the same weights on the same software. At the end it samples 10 digits per class with the
plain (unsharded) Euler loop, has the held-out judge label them, and writes the checkpoint atomically in
diffusers layout with its training record.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from converters.flux import diffusers_table  # noqa: E402
from converters.keymap import invert  # noqa: E402
from converters.safetensors_io import write_safetensors  # noqa: E402
from jaxdit.models.flux import FluxTransformer  # noqa: E402
from jaxdit.pipelines import digits, latents  # noqa: E402
from jaxdit.pipelines import tiny_digits as tiny  # noqa: E402
from jaxdit.samplers import flow_match_euler as euler  # noqa: E402

IMG_IDS = latents.image_positions(tiny.LATENT_SIZE, tiny.LATENT_SIZE)
TXT_IDS = latents.text_positions(tiny.TEXT_TOKENS)


def predict(model, tables, x, labels, sigma):
    tokens, pooled = tables["tokens"][labels], tables["pooled"][labels]
    return model(x, tokens, pooled, sigma, IMG_IDS, TXT_IDS)


def loss_fn(params, graphdef, tables, x0, labels, noise, sigma):
    model = nnx.merge(graphdef, params)
    s = sigma[:, None, None]
    xs = (1 - s) * x0 + s * noise
    v = predict(model, tables, xs, labels, sigma)
    return jnp.mean(jnp.square(v - (noise - x0)))


def sample(model, tables, labels, *, steps, cfg_scale, seed):
    """Plain unsharded Euler sampling with true CFG (the reference loop the pipeline must equal)."""
    schedule = euler.set_timesteps(euler.FlowMatchEulerConfig(shift=1.0), sigmas=euler.linear_sigmas(steps))
    n = len(labels)
    x = jnp.asarray(
        latents.pack(
            latents.initial_noise(seed, (n, tiny.LATENT_CHANNELS, tiny.LATENT_SIZE, tiny.LATENT_SIZE))
        )
    )
    null = jnp.full((n,), tiny.NULL_LABEL)

    @jax.jit
    def step(x, sigma, sigma_next):
        s = jnp.full((n,), sigma)
        v_c = predict(model, tables, x, labels, s)
        v_u = predict(model, tables, x, null, s)
        return euler.step(x, v_u + cfg_scale * (v_c - v_u), sigma, sigma_next)

    for i in range(steps):
        x = step(x, schedule.sigmas[i], schedule.sigmas[i + 1])
    return np.asarray(latents.unpack(np.asarray(x), tiny.LATENT_SIZE, tiny.LATENT_SIZE))[:, 0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-steps", type=int, default=20)
    parser.add_argument("--cfg-scale", type=float, default=3.0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "jaxdit/assets/tiny-digits"
    )
    args = parser.parse_args(argv)

    (images, labels), _ = digits.load_split()
    x_all = latents.pack(images[:, None]).astype(np.float32)  # [N, 64, 4]
    model = FluxTransformer(tiny.CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    key = jax.random.key(args.seed)
    k_tok, k_pool, key = jax.random.split(key, 3)
    tables = {
        "tokens": 0.5
        * jax.random.normal(k_tok, (tiny.NUM_CLASSES + 1, tiny.TEXT_TOKENS, tiny.CONFIG.context_in_dim)),
        "pooled": 0.5 * jax.random.normal(k_pool, (tiny.NUM_CLASSES + 1, tiny.CONFIG.vec_in_dim)),
    }
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(200, args.steps // 4), args.steps, args.lr * 0.05
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))
    trainable = (params, tables)
    opt_state = optimizer.init(trainable)

    @jax.jit
    def train_step(trainable, opt_state, key):
        k_idx, k_noise, k_sig, k_drop = jax.random.split(key, 4)
        idx = jax.random.randint(k_idx, (args.batch,), 0, len(labels))
        x0 = jnp.asarray(x_all)[idx]
        y = jnp.asarray(labels)[idx]
        y = jnp.where(jax.random.uniform(k_drop, (args.batch,)) < 0.1, tiny.NULL_LABEL, y)
        noise = jax.random.normal(k_noise, x0.shape)
        sigma = jax.nn.sigmoid(jax.random.normal(k_sig, (args.batch,)))

        def loss(t):
            return loss_fn(t[0], graphdef, t[1], x0, y, noise, sigma)

        value, grads = jax.value_and_grad(loss)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    start = time.perf_counter()
    ema = None
    for i in range(args.steps):
        key, sub = jax.random.split(key)
        trainable, opt_state, value = train_step(trainable, opt_state, sub)
        if i % 250 == 0 or i == args.steps - 1:
            value = float(value)
            ema = value if ema is None else ema
            print(f"step {i:5d}  loss {value:.4f}  {time.perf_counter() - start:6.1f}s", flush=True)
    train_seconds = time.perf_counter() - start
    params, tables = trainable
    model = nnx.merge(graphdef, params)

    eval_labels = jnp.repeat(jnp.arange(tiny.NUM_CLASSES), 10)
    images_gen = sample(model, tables, eval_labels, steps=args.sample_steps, cfg_scale=args.cfg_scale, seed=1)
    accuracy = digits.DigitJudge().accuracy(images_gen, np.asarray(eval_labels))
    print(
        f"trained {args.steps} steps in {train_seconds:.0f}s; judge accuracy on 100 samples: {accuracy:.1%}"
    )

    # Write atomically: build the folder beside the target, then swap it in.
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}
    state_dict = invert(diffusers_table(tiny.CONFIG), flat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        write_safetensors(tmp / tiny.TRANSFORMER_DIR / tiny.WEIGHTS_FILE, state_dict)
        config_json = json.dumps(tiny.diffusers_config(tiny.CONFIG), indent=2) + "\n"
        (tmp / tiny.TRANSFORMER_DIR / "config.json").write_text(config_json)
        write_safetensors(
            tmp / tiny.ENCODER_DIR / tiny.EMBEDDINGS_FILE,
            {k: np.asarray(v, np.float32) for k, v in tables.items()},
        )
        record = {
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "seed": args.seed,
            "train_seconds": round(train_seconds, 1),
            "final_loss": float(value),
            "sample_steps": args.sample_steps,
            "cfg_scale": args.cfg_scale,
            "judge_accuracy_100": accuracy,
            "jax": jax.__version__,
            "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        }
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        old = args.out.with_name(args.out.name + ".old")
        if args.out.exists():
            args.out.rename(old)
        tmp.rename(args.out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
