"""The experts' grouped GEMM at a decode step's rows (bench_decode.py's gmm_rows job).

Decode batches past models.serving.EXPERT_KERNEL_ROWS run a mixture of experts' experts through the
grouped GEMM over their [E, n, k] matrices, read transposed (`grouped_matmul_nk`): a batch of b rows
routes b x top_k rows, in its decode bucket's padded count. The Hopper tiles (128 rows x 256 columns)
compute a 128-row tile for a group of a few rows. This times that call at 32, 128 and 512 rows (the
buckets of 16, 64 and 256 at top 2) on the preset's expert shapes under the default tiles, the tiles
grouped_matmul.nk_tiles ships, and narrower ones (16 rows), each against the default's output, with the
bytes of the experts the rows touch over the time as the rate. Then prompt chunks' rows (1,024 / 4,096:
512 / 2,048 tokens at top 2) under the default and wider-contraction tiles, and at every row count the
same product over [E, k, n] matrices read in place (`kn layout`): what reading them transposed costs.
"""
from __future__ import annotations

import numpy as np

# Narrow column tiles over long contraction chunks: more programs per touched expert, each with
# more bytes in flight. Shared memory per stage: (16 x block_k + block_k x block_n) x 2 bytes.
FEW_ROW_TILES = {
    "n64k256s2": dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=2),
    "n64k256s3": dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3),
    "n64k128s3": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
    "n32k256s3": dict(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3),
    "n128k128s3": dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3),
    "m16n256k64s3w8": dict(block_m=16, block_n=256, block_k=64, num_warps=8, num_stages=3),   # Hopper's, 16 rows
    "m32n128k64s4": dict(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4),
}
# Prompt chunks' rows read [E, n, k] transposed: each weight row's bk contraction elements are one
# contiguous run (128 B at the default's 64), so longer chunks read longer runs.
PROMPT_TILES = {
    "m128n256k128s2w8": dict(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=2),
    "m128n128k128s3w8": dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    "m64n256k128s2w8": dict(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=2),
    "m128n128k64s4w4": dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4),
}


def route_rows(rng, rows: int, experts: int, top_k: int) -> np.ndarray:
    """group_sizes [experts] of `rows // top_k` tokens, each sent to top_k distinct experts at random."""
    tokens = max(1, rows // top_k)
    picks = np.concatenate([rng.choice(experts, size=top_k, replace=False) for _ in range(tokens)])
    return np.bincount(picks, minlength=experts).astype(np.int32)


def gmm_rows(cfg, smoke: bool = False, rows=(32, 128, 512, 1024, 4096)) -> list[dict]:
    """Rows of the gmm_rows job: us per call and GB/s of the touched experts, per (op, rows, tiles)."""
    import jax
    import jax.numpy as jnp

    from meshlab.bench.timing import median_time
    from pallas_kernels import grouped_matmul as gm
    from pallas_kernels import grouped_matmul_triton as gmt
    rng = np.random.default_rng(0)
    dt = jnp.float32 if smoke else jnp.bfloat16
    few = {k: gmt.TritonTiles(**v) for k, v in FEW_ROW_TILES.items()}
    wide = {k: gmt.TritonTiles(**v) for k, v in PROMPT_TILES.items()}
    shapes = {"gate_up": (cfg.d_model, 2 * cfg.expert_mlp_dim), "down": (cfg.expert_mlp_dim, cfg.d_model)}
    out = []
    for op, (k, n) in shapes.items():
        w = jnp.asarray(rng.normal(size=(cfg.n_experts, n, k)), dt)                       # [E, n, k], as serving holds them
        w_kn = jnp.swapaxes(w, 1, 2)                                                       # [E, k, n], read in place
        for m in rows:
            x = jnp.asarray(rng.normal(size=(m, k)), dt)
            gs = jnp.asarray(route_rows(rng, m, cfg.n_experts, cfg.top_k))
            experts = int((np.asarray(gs) > 0).sum())
            touched = experts * k * n * jnp.dtype(dt).itemsize                     # bytes of the experts with rows
            tiles = {"default": gmt.TritonTiles.default(dt), "shipped": gm.nk_tiles(m, dt),
                     **(few if m <= 512 else {}), **(wide if m >= 512 else {}), "kn layout": None}
            ref = None
            for name, t in tiles.items():
                kn = name == "kn layout"
                f = jax.jit(lambda x, w, gs, t=t or gmt.TritonTiles.default(dt), kn=kn: gmt.gmm_call(
                    x, w, gs, t, smoke, trans_rhs=not kn))
                args = (x, w_kn if kn else w, gs)
                got = np.asarray(f(*args), np.float32)
                ref = got if ref is None else ref
                sec = median_time(f, *args, warmup=2, reps=5 if smoke else 10, inner=1 if smoke else 10)
                out.append({"section": "gmm_rows", "setting": f"{op} rows={m} {name}", "value": sec * 1e6, "unit": "us",
                            "note": f"{touched / sec / 1e9:.0f} GB/s of the {experts} experts "
                                    f"touched, max difference from the default {np.abs(got - ref).max():.1e}"})
    return out
