"""Fine-tune a small Wan-style video DiT (flax nnx) with sparse attention and optax.

Flow matching as Wan2.1 trains: x_t = (1 - t) x0 + t noise, the model predicts the velocity
noise - x0 at timestep 1000 t, mean squared error. Every self-attention layer runs
``tj.sparse_attention`` with either one static block mask (``--mask window``: a sliding window
over blocks of video tokens, planned once on the host) or a VSA-like mask that each layer
builds from its own q and k at every step (``--mask vsa``: per-head top-k of block-pooled
scores, planned on the device inside the compiled step); its gradients come from the backward
over plans (``runtime.core``). ``--checkpoint`` wraps the model's forward in ``jax.checkpoint``
(``nnx.remat``): activations are recomputed in the backward.

    python -m tessera_jax.tools.finetune --steps 40            # tiny model, CPU
    python -m tessera_jax.tools.finetune --mask vsa --keep 0.25 # masks from q and k
    python -m tessera_jax.tools.finetune --layers 4 --heads 4 --head-dim 64 --latent 5,16,16
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as tj
from tessera_jax.masks import dynamic as dm
from tessera_jax.tools import cli

PROG = "python -m tessera_jax.tools.finetune"
try:        # the flax extra (flax brings optax): without it the tool says how to install it
    import flax.nnx as nnx
    import optax

    from tessera_jax.flax import DynamicSchedule, LayerAttention
    from tessera_jax.models import WAN21_1_3B, WanConfig, WanModel
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in ("flax", "optax"):
        raise
    MISSING_EXTRA = cli.missing_extra(e.name.split(".")[0], "flax")
else:
    MISSING_EXTRA = None


def _require_flax() -> None:
    if MISSING_EXTRA is not None:
        raise ModuleNotFoundError(f"tessera_jax.tools.finetune: {MISSING_EXTRA}", name="flax")

__all__ = ["tiny_config", "window_mask", "make_data", "train"]


def tiny_config(layers=2, heads=2, head_dim=16) -> WanConfig:
    """A Wan2.1 block structure shrunk to CPU size (4 latent channels, 32-dim text)."""
    _require_flax()
    return WAN21_1_3B.replace(num_layers=layers, num_heads=heads, head_dim=head_dim,
                              ffn_dim=4 * heads * head_dim, text_dim=32, text_len=8,
                              in_channels=4, out_channels=4, freq_dim=32)


def window_mask(num_tokens: int, block: int, width: int, num_heads: int) -> tj.BlockMask:
    """Per-head sliding windows over blocks of ``block`` tokens: head h keeps the blocks within
    ``width + h % 2`` of its own (a different mask per head, static)."""
    n = -(-num_tokens // block)
    i = np.arange(n)
    w = width + np.arange(num_heads) % 2
    blocks = np.abs(i[None, :, None] - i[None, None, :]) <= w[:, None, None]
    return tj.BlockMask.uniform(num_tokens, num_tokens, block, block, blocks)


def make_data(cfg: WanConfig, latent, num: int, seed: int = 0):
    """(latents [num, T, H, W, C], text [num, Lt, text_dim]): smooth synthetic 'videos' (a few
    moving sinusoids per sample) and random text embeddings; a dataset the model can fit."""
    rng = np.random.default_rng(seed)
    T, H, W = latent
    t, y, x = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    vids = []
    for _ in range(num):
        f = rng.uniform(0.2, 0.8, (cfg.in_channels, 3))
        ph = rng.uniform(0, 2 * np.pi, cfg.in_channels)
        vids.append(np.stack([np.sin(f[c, 0] * x + f[c, 1] * y + f[c, 2] * t + ph[c])
                              for c in range(cfg.in_channels)], -1))
    text = rng.standard_normal((num, cfg.text_len, cfg.text_dim))
    return jnp.asarray(np.stack(vids), jnp.float32), jnp.asarray(text, jnp.float32)


def train(cfg: WanConfig | None = None, *, latent=(3, 8, 8), steps: int = 30, lr: float = 3e-3,
          batch: int = 2, block: int = 8, width: int = 1, checkpoint: bool = False,
          mask: str = "window", keep: float = 0.25, seed: int = 0, log=None) -> list[float]:
    """Fine-tunes a randomly initialised model on ``make_data`` for ``steps`` AdamW steps with
    the sparse mask in every layer (``mask``: "window", static, or "vsa", from q and k with
    ``keep`` of the key blocks per query block); returns the loss of each step (each step sees
    the whole dataset of ``batch`` samples with fresh noise and timesteps)."""
    _require_flax()
    cfg = cfg or tiny_config()
    if mask not in ("window", "vsa"):
        raise ValueError(f"mask must be 'window' or 'vsa', got {mask!r}")
    model = WanModel(cfg, rngs=nnx.Rngs(seed))
    tokens = model.num_tokens(latent)
    if mask == "window":
        static = [window_mask(tokens, block, width, cfg.num_heads)] * cfg.num_layers
    else:   # one VSA rule for every layer, sparse at every step
        sched = DynamicSchedule((dm.VSA(block=block, keep=keep),),
                                np.ones((1, cfg.num_layers), np.int32))
    x0, text = make_data(cfg, latent, batch, seed)
    opt = nnx.Optimizer(model, optax.adamw(lr, weight_decay=1e-4), wrt=nnx.Param)

    def forward(model, xt, t, text):
        if mask == "window":
            return model(xt, t, text, masks=static)
        state = tuple(r.init_state(None, None, None) for r in sched.rules)   # VSA: stateless
        layers = [LayerAttention(sched, i, 0, state) for i in range(cfg.num_layers)]
        return model(xt, t, text, masks=layers)

    if checkpoint:
        forward = nnx.remat(forward)

    def loss_fn(model, key):
        kn, kt = jax.random.split(key)
        noise = jax.random.normal(kn, x0.shape, x0.dtype)
        t = jax.random.uniform(kt, (x0.shape[0],))
        tb = t[:, None, None, None, None]
        xt = (1 - tb) * x0 + tb * noise
        v = forward(model, xt, 1000.0 * t, text)
        return jnp.mean((v - (noise - x0)) ** 2)

    @nnx.jit
    def step(model, opt, key):
        loss, grads = nnx.value_and_grad(loss_fn)(model, key)
        opt.update(model, grads)
        return loss

    key = jax.random.key(seed + 1)
    losses = []
    for i in range(steps):
        key, sub = jax.random.split(key)
        t0 = time.perf_counter()
        losses.append(float(step(model, opt, sub)))
        if log is not None:
            log(f"step {i:3d}  loss {losses[-1]:.4f}  {1e3 * (time.perf_counter() - t0):.1f} ms")
    return losses


def parser() -> cli.Parser:
    """The tool's options (building it imports neither flax nor the models)."""
    ap = cli.Parser("tessera_jax.tools.finetune", description=__doc__.splitlines()[0],
                    epilog="Needs the flax extra: pip install 'tessera_jax[flax]'.")
    ap.add_argument("--steps", type=cli.positive_int, default=40,
                    help="AdamW steps (default %(default)s); the first one compiles")
    ap.add_argument("--lr", type=cli.positive_float, default=3e-3,
                    help="learning rate (default %(default)s)")
    ap.add_argument("--layers", type=cli.positive_int, default=2,
                    help="transformer blocks (default %(default)s)")
    ap.add_argument("--heads", type=cli.positive_int, default=2,
                    help="attention heads (default %(default)s)")
    ap.add_argument("--head-dim", type=cli.positive_int, default=16,
                    help="dimension per head (default %(default)s)")
    ap.add_argument("--latent", type=cli.int_tuple("T,H,W"), default=(3, 8, 8),
                    metavar="T,H,W", help="latent frames, height, width; H and W even (the "
                    "model's 1x2x2 patch; default 3,8,8)")
    ap.add_argument("--block", type=cli.positive_int, default=8,
                    help="tokens per mask block (default %(default)s)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="jax.checkpoint (nnx.remat) the forward: recompute in the backward")
    ap.add_argument("--mask", default="window", choices=("window", "vsa"),
                    help="window: a static sliding window over blocks; vsa: each layer builds "
                    "its mask from q and k at every step (default %(default)s)")
    ap.add_argument("--keep", type=cli.fraction, default=0.25,
                    help="vsa: fraction of the key blocks kept per query block, in (0, 1] "
                    "(default %(default)s)")
    return ap


def main(argv=None) -> None:
    if MISSING_EXTRA is not None:     # before parsing: --help too says what to install
        raise SystemExit(f"{PROG}: error: {MISSING_EXTRA}")
    ap = parser()
    args = ap.parse_args(argv)
    cfg = tiny_config(args.layers, args.heads, args.head_dim)
    if any(n % p for n, p in zip(args.latent, cfg.patch)):
        ap.error(f"argument --latent: T,H,W must be multiples of the patch size {cfg.patch}, "
                 f"got {','.join(map(str, args.latent))}")
    with cli.ticking("compiling the training step", total=args.steps, unit="step") as bar:
        def log(msg):
            bar.set_description("training", refresh=False)
            bar.update(1)
            bar.write(msg)

        losses = train(cfg, latent=args.latent,
                       steps=args.steps, lr=args.lr, block=args.block,
                       checkpoint=args.checkpoint, mask=args.mask, keep=args.keep, log=log)
    k = max(1, len(losses) // 5)
    print(f"loss: first {k} steps {np.mean(losses[:k]):.4f} -> last {k} "
          f"{np.mean(losses[-k:]):.4f}")


if __name__ == "__main__":
    main()
