"""Llama-3 decoder, top to bottom: config, RoPE, RMSNorm, attention (GQA), SwiGLU MLP, block, model.

Parameters carry logical axis names only (`logical=` metadata); activations are placed with
`meshlab.rules.constrain`; every weight goes through `materialize` (cast to the compute dtype,
gathered when stored sharded) right where it is used, so FSDP's gather happens per layer inside
the layer scan. Matmuls take bf16 (or fp16/fp32) operands, accumulate in fp32 inside the GEMM and write the
compute dtype (`_mm`); the fp32 master weights live in the train state. Serving (this step's
tokens over a KV cache, prompt chunks and decode) is models/serving.py.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshlab.parallel import attention as attention_op
from meshlab.parallel.collective_matmul import gathered_matmul, scattered_matmul
from meshlab.rules import constrain, is_local, is_split, materialize, shares_axis
from models import fp8
from models.vjp_ops import mm_f32_out, swiglu_pair, take_rows
from models.remat import REMAT_POLICIES, remat as _remat
from pallas_kernels import cross_entropy_onepass as fused_ce_onepass
from pallas_kernels.attention import available as kernel_available
from pallas_kernels import fused_cross_entropy as fused_ce, fused_rmsnorm, rope as rope_kernels, swiglu as swiglu_kernel

F32 = jnp.float32


@dataclasses.dataclass
class LlamaConfig:
    name: str = "tiny"
    vocab_size: int = 257                 # real vocabulary (bytes + end-of-document); the tables are padded (padded_vocab)
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 192
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0      # Llama-3 frequency scaling; 0 = off
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    vocab_multiple: int = 128             # pad the vocab for aligned matmul tiles
    # how it runs
    dtype: str = "bfloat16"               # compute dtype: bfloat16 | float16 (loss scaling) | float32
    # auto: the fastest implementation measured on this platform (pallas_kernels/attention.py);
    # on CPU that is xla, the reference, so CPU numerics are those of `xla`
    attention: str = "auto"               # auto | xla | cudnn | pallas
    # none | full | save_dots | save_dots_no_batch | save_dots_attn, or auto: an engine (the trainer,
    # meshlab/train/fit.py) picks the fastest policy whose planned memory fits the device
    remat: str = "none"
    # dense | chunked | pallas (fused linear + cross-entropy) | onepass (the loss sum's gradients
    # computed in its forward: 3 logits-sized GEMMs as dense, one [2048, V] slab at a time; jnp, so
    # it partitions under tensor-parallel rules too; token_losses gives the chunked values)
    loss_impl: str = "dense"
    # onepass's token slab. Each slab after the first costs one dW read-modify-write (fp32 [d, V]:
    # 2.1 GB at llama3_1b); a larger slab holds more logits (fp32 + bf16 dlogits: 3.2 GB per 4096
    # tokens at V=128256). At llama3_1b, 8192 keeps dense's speed in less memory and 4096 trades a
    # little speed for less still (docs/benchmarks.md#fused-ops).
    loss_chunk: int = 8192
    # onepass's logits slab as the head GEMM writes it: float32, or bfloat16 (half the bytes for the
    # slab's passes, which upcast in registers; torch recipes' bf16 logits). Rounds each logit once.
    loss_logits_dtype: str = "float32"
    # onepass's passes over the slab (log-sum-exp, the label's logit, dlogits): xla (jnp; GSPMD
    # partitions it, so it runs under any rule file) or pallas (pallas_kernels/softmax_rows.py: one
    # read for the statistics, one read + write for dlogits). auto: pallas on a Triton GPU where the
    # loss sees whole arrays (one device, or the data-parallel step's shard_map), xla elsewhere.
    loss_softmax: str = "auto"
    # Pallas fused ops (pallas_kernels/), interpreted off-GPU. They run per device, so use them with
    # data-parallel / FSDP rule files; a tensor-sharded operand would be gathered around the call.
    fused_norm: bool = False              # RMSNorm fused with the residual add
    fused_swiglu: bool = False            # gate/up matmuls + SiLU*up in one kernel, recomputed in backward
    # gate and up as two [d, f] GEMMs (split) or one over the pair stacked [d, f, 2] (stacked): one GEMM
    # each way, d(gate|up) in one elementwise pass, one [b, s, f] activation less saved per layer, one
    # tensor-parallel all-reduce less per layer. Same parameters and checkpoints either way. On one H200
    # (llama3_1b, unrolled, remat none) stacked ran at split's speed in 6.5 GiB more compiled memory.
    gate_up: str = "split"
    fused_rope: bool = False              # Q and K rotated in one kernel (XLA's fusion is faster on H200)
    # bfloat16 | float8: the decoder layers' projection GEMMs (q|k|v, o, gate, up, down) in the training
    # forward and backward; float8 is e4m3 forward / e5m2 gradients, per-tensor scaling (models/fp8.py)
    matmul_dtype: str = "bfloat16"
    # The layer loop as a lax.scan over the stacked weights (one compiled layer: fast compiles) or
    # unrolled (each layer's residuals and weight gradients in their own buffers: no stacked
    # [n_layers, ...] buffers to zero-fill and copy into, at n_layers times the compile work).
    scan_layers: bool = True

    @property
    def padded_vocab(self) -> int:
        return int(math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple)

    def matmul_param_count(self) -> int:
        """N of the 6N rule: every matmul weight, the LM head included (counted again when tied,
        since the tied embedding is used as a matmul there), norms and the lookup excluded."""
        d, hd = self.d_model, self.head_dim
        per_layer = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * d * self.mlp_dim
        return self.n_layers * per_layer + d * self.padded_vocab

    def train_flops_per_token(self, seq_len: int) -> float:
        """6N + causal attention 6*L*S*d_model (DESIGN.md, Measuring)."""
        return 6.0 * self.matmul_param_count() + 6.0 * self.n_layers * seq_len * self.n_heads * self.head_dim

    # the fields that must be >= 1 (a class attribute, not a config field)
    SIZES = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab_multiple")

    def validate(self) -> None:
        """ValueError naming the first field at fault."""
        for key in self.SIZES:
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        for key in ("norm_eps", "init_std"):
            if not getattr(self, key) > 0:        # NaN too
                raise ValueError(f"model.{key}={getattr(self, key)} must be > 0")
        if self.vocab_size < 2:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be >= 2")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
        if self.remat not in REMAT_POLICIES + ("auto",):
            raise ValueError(f"model.remat={self.remat!r} is not one of {REMAT_POLICIES + ('auto',)}"
                             + _near(self.remat, REMAT_POLICIES + ("auto",)))
        from pallas_kernels.attention import IMPLS
        if self.attention not in IMPLS:
            raise ValueError(f"model.attention={self.attention!r} is not one of {', '.join(IMPLS)}"
                             + _near(self.attention, IMPLS))
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"model.dtype={self.dtype!r} must be bfloat16, float16 or float32")
        if self.loss_chunk < 1:
            raise ValueError(f"model.loss_chunk={self.loss_chunk} must be a positive number of tokens")
        if self.loss_logits_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.loss_logits_dtype={self.loss_logits_dtype!r} must be float32 or bfloat16")
        if self.loss_softmax not in LOSS_SOFTMAX:
            raise ValueError(f"model.loss_softmax={self.loss_softmax!r} must be one of {', '.join(LOSS_SOFTMAX)}"
                             + _near(self.loss_softmax, LOSS_SOFTMAX))
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"model.loss_impl={self.loss_impl!r} must be one of {', '.join(LOSS_IMPLS)}"
                             + _near(self.loss_impl, LOSS_IMPLS))
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"model.matmul_dtype={self.matmul_dtype!r} must be one of {', '.join(MATMUL_DTYPES)}"
                             + _near(self.matmul_dtype, MATMUL_DTYPES))
        if self.matmul_dtype == "float8" and self.dtype == "float16":
            raise ValueError("model.matmul_dtype=float8 with model.dtype=float16: the per-tensor scales of small "
                             "gradients fall outside fp16's range; use model.dtype=bfloat16 with float8")
        if self.gate_up not in ("split", "stacked"):
            raise ValueError(f"model.gate_up={self.gate_up!r} must be split or stacked")
        if self.matmul_dtype == "float8" and self.fused_swiglu:
            raise ValueError("model.matmul_dtype=float8 runs gate/up as FP8 GEMMs, model.fused_swiglu=true runs them "
                             "in a bf16 Pallas kernel: set model.fused_swiglu=false (or matmul_dtype=bfloat16)")


MATMUL_DTYPES = ("bfloat16", "float8")

# auto: an engine picks (the trainer: onepass on GPU, dense elsewhere; meshlab/train/fit.py)
LOSS_IMPLS = ("dense", "chunked", "pallas", "onepass", "auto")
LOSS_SOFTMAX = ("auto", "xla", "pallas")


def _near(value: str, choices) -> str:
    """`; did you mean 'x'?` for a near-miss spelling, else ''."""
    import difflib
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


PRESETS = {
    "tiny": LlamaConfig(),
    "llama3_1b": LlamaConfig(name="llama3_1b", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                             n_kv_heads=8, head_dim=64, mlp_dim=8192, rope_theta=500000.0, rope_scaling_factor=32.0,
                             tie_embeddings=True),
    "llama3_3b": LlamaConfig(name="llama3_3b", vocab_size=128256, d_model=3072, n_layers=28, n_heads=24,
                             n_kv_heads=8, head_dim=128, mlp_dim=8192, rope_theta=500000.0, rope_scaling_factor=32.0,
                             tie_embeddings=True),
    "llama3_8b": LlamaConfig(name="llama3_8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=500000.0, rope_scaling_factor=8.0,
                             tie_embeddings=False),
}


# -- RoPE ------------------------------------------------------------------------------------
def rope_scaling(cfg: LlamaConfig):
    """Llama-3 frequency scaling as the dict pallas_kernels.rope takes (None when off)."""
    if not cfg.rope_scaling_factor:
        return None
    return {"factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position}


def apply_rope(cfg: LlamaConfig, q, k, positions):
    """Rotate-half RoPE (Hugging Face layout) of q [b, s, h, d] and k [b, s, kvh, d]."""
    if cfg.fused_rope:
        return rope_kernels.apply_rope(q, k, positions, theta=cfg.rope_theta, scaling=rope_scaling(cfg),
                                       interpret=_interpret())
    return rope_kernels.apply_rope_reference(q, k, positions, theta=cfg.rope_theta, scaling=rope_scaling(cfg))


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _loss_softmax(asked: str) -> str:
    """The onepass loss's slab passes: model.loss_softmax resolved for where this trace runs."""
    local = is_local()
    if asked == "pallas" and not local:
        raise ValueError("model.loss_softmax=pallas runs per device, but the rule file splits the loss's tokens or "
                         "vocabulary over a mesh axis the step does not map by hand (a kernel there would be "
                         "gathered whole); use model.loss_softmax=auto or xla with this rule file")
    if asked == "auto":
        return "pallas" if local and kernel_available("pallas") else "xla"   # "pallas": the Triton lowering
    return asked


# -- layers ----------------------------------------------------------------------------------
def _param(rngs, shape, names, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, F32), logical=names)


def _mm(spec, x, w):
    """einsum with its output in the operands' compute dtype. The GEMM accumulates in fp32 either
    way (cuBLAS / Triton); an fp32 *output* would cost twice the bytes, and JAX transposes it with
    an fp32 cotangent, so every backward GEMM became fp32 x fp32 (upcast operands, TF32 rate)."""
    return jnp.einsum(spec, x, w)


def _layer_mm(cfg: LlamaConfig):
    """The GEMM of the decoder layers' projections in training (`__call__`): `_mm`, or FP8 under
    matmul_dtype=float8. The LM head, the embedding and attention stay in the compute dtype, as
    torchao's and Transformer Engine's float8 recipes leave them: the head's logits feed the softmax
    and the loss, attention's scores its softmax, the numerically sensitive places for a 3-bit
    mantissa (the head is also tied to the embedding here). Serving (models/serving.py) keeps `_mm`."""
    return fp8.fp8_einsum if cfg.matmul_dtype == "float8" else _mm


def _w(var, dtype):
    """The compute-ready value of a parameter (cast, gathered if stored sharded)."""
    return materialize(var[...], var.get_metadata()["logical"], dtype)


def embed_lookup(embed, tokens, dtype):
    """Rows of the embedding parameter for tokens [b, s] -> [b, s, d] in dtype. The lookup's gradient
    is a scatter-add of b*s rows into [V, d], a frequent token's thousands of rows into one; autodiff
    of a bf16 lookup adds them in bf16, each add rounded (Zipf-skewed byte ids, 8-16k tokens, XLA:CPU:
    5-7% error in the most frequent id's row). Here they add in fp32 and the sum is rounded once. The
    forward is unchanged: the weight cast, then gathered if stored sharded (half the bytes).

    The rows come out whole per batch row before the caller's constraint splits them as it asks:
    XLA's partitioner aborts the process on this gather when the table's vocabulary and width are
    split over two axes and the output asks for its sequence split (inside the step's manual
    region, jax 0.10, CPU). The cost is at most one all-reduce of [b, s, d] a step. It also aborts
    when the rows' batch is split over an Auto axis that splits the table too: its width (a batch
    axis the batch itself is not split over, inside a pipeline stage), or its vocabulary while the
    width is split over another axis. There the rows are first taken with the table's width split
    (every row on every device, 1/n of its width), then moved to the batch split (an all-to-all
    of [b, s, d])."""
    rows = take_rows(_w(embed, dtype), tokens)                                           # [b, s, d]
    if shares_axis("embed", "act_batch") or (shares_axis("vocab", "act_batch") and is_split("embed")):
        rows = constrain(rows, (None, None, "embed"))
    return constrain(rows, ("act_batch", None, None))


class RMSNorm(nnx.Module):
    def __init__(self, cfg: LlamaConfig):
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), F32), logical=("embed",))
        self.eps = cfg.norm_eps
        self.fused = cfg.fused_norm

    def __call__(self, x, residual=None):
        """x [b, s, d] -> normed; with `residual`, (norm(x + residual), x + residual)."""
        scale = _w(self.scale, F32)
        if self.fused:
            return fused_rmsnorm.rms_norm(x, scale, eps=self.eps, residual=residual, interpret=_interpret())
        if residual is not None:
            x = x + residual
            return self(x), x
        xf = x.astype(F32)   # statistics in fp32 whatever the compute dtype
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps) * scale
        return y.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, kvh, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = _param(rngs, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = _param(rngs, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        # Output projection scaled down with depth (GPT-2's 1/sqrt(2L)) so the residual stays O(1).
        self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), cfg.init_std / math.sqrt(2 * cfg.n_layers))
        self.cfg = cfg

    def __call__(self, x, positions, segment_ids):
        cfg, dt, mm = self.cfg, jnp.dtype(self.cfg.dtype), _layer_mm(self.cfg)
        q, k, v = gathered_matmul(mm, "bsd,dhk->bshk", x, _w(self.wq, dt), _w(self.wk, dt), _w(self.wv, dt))  # [b, s, h|kvh, hd]
        q = constrain(q, ("act_batch", "act_attn_seq", "act_heads", None))
        k = constrain(k, ("act_batch", "act_attn_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_attn_seq", "act_kv_heads", None))
        q, k = apply_rope(cfg, q, k, positions)
        o = attention_op(q, k, v, impl=cfg.attention, causal=True, segment_ids=segment_ids)         # [b, s, h, hd]
        o = constrain(o, ("act_batch", "act_attn_seq", "act_heads", None))
        out = scattered_matmul(mm, "bshk,hkd->bsd", o, _w(self.wo, dt))  # [b, s, d]
        return constrain(out, ("act_batch", "act_seq", "act_embed"))

class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), cfg.init_std / math.sqrt(2 * cfg.n_layers))
        self.cfg = cfg

    def __call__(self, x, mm=_mm):
        """x [b, s, d] -> [b, s, d]; mm: the GEMM of the three projections (Block passes _layer_mm's)."""
        dt = jnp.dtype(self.cfg.dtype)
        if self.cfg.fused_swiglu:
            b, s, d = x.shape
            h = swiglu_kernel.swiglu(x.reshape(b * s, d), _w(self.w_gate, dt), _w(self.w_up, dt),
                                     interpret=_interpret()).reshape(b, s, -1).astype(dt)  # [b, s, f]
        elif self.cfg.gate_up == "stacked":
            # Stacked as stored, then cast and gathered as one weight: a ZeRO-3 gather stays a gather
            # (models/remat.py does not keep it for the backward), not a stack of two gathered halves.
            pair = jnp.stack([self.w_gate[...], self.w_up[...]], axis=-1)             # [d, f, 2]
            w_gate_up = materialize(pair, ("embed", "mlp", None), dt)
            (gate_up,) = gathered_matmul(mm, "bsd,dfg->bsfg", x, w_gate_up)          # [b, s, f, 2]
            h = swiglu_pair(gate_up)                                                  # [b, s, f]
        else:
            gate, up = gathered_matmul(mm, "bsd,df->bsf", x, _w(self.w_gate, dt), _w(self.w_up, dt))   # [b, s, f] x2
            h = (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(dt)   # one fusion; fp32 math
        return self.down(h, mm)

    def down(self, h, mm=_mm):
        """SwiGLU activations h [b, s, f] -> [b, s, d] (the serving path's fused gate|up ends here too)."""
        h = constrain(h, ("act_batch", "act_attn_seq", "act_mlp"))
        out = scattered_matmul(mm, "bsf,fd->bsd", h, _w(self.w_down, jnp.dtype(self.cfg.dtype)))  # [b, s, d]
        return constrain(out, ("act_batch", "act_seq", "act_embed"))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, segment_ids):  # x [b, s, d], the residual stream
        with jax.named_scope("attention"):   # named for profiles (profile.start_step)
            attn_out = self.attn(self.attn_norm(x), positions, segment_ids)
        normed, x = self.mlp_norm(attn_out, residual=x)       # the residual add fused into the norm
        x = constrain(x, ("act_batch", "act_seq", "act_embed"))
        with jax.named_scope("mlp"):
            x = x + self.mlp(normed, _layer_mm(self.attn.cfg))
        return constrain(x, ("act_batch", "act_seq", "act_embed"))

# -- the model -------------------------------------------------------------------------------
def layer_loop(body, x, block_state, cfg):
    """x through every layer: `body(x, one_layer) -> (x, out)` over the stacked [n_layers, ...]
    leaves, as a scan or unrolled (`cfg.scan_layers`); returns x and the per-layer outputs stacked."""
    if cfg.scan_layers:
        return jax.lax.scan(body, x, block_state)
    # One split per stacked leaf, not `leaf[i]` per layer: the gradient of a split is one concatenate
    # of the layers' gradients, where n_layers indexings transpose to n_layers zero-padded copies
    # summed (an add-of-pads fusion that ran at a third of HBM bandwidth, ~10 ms of llama3_1b's step).
    leaves, treedef = jax.tree.flatten(block_state)
    per_layer = [[jnp.squeeze(s, 0) for s in jnp.split(leaf, cfg.n_layers)] for leaf in leaves]
    outs = []
    for i in range(cfg.n_layers):
        x, out = body(x, jax.tree.unflatten(treedef, [layers[i] for layers in per_layer]))
        outs.append(out)
    return x, jax.tree.map(lambda *o: jnp.stack(o), *outs)


class Llama(nnx.Module):
    block_cls = Block                           # the layer; another architecture swaps only this (models/moe.py)

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"), cfg.init_std)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(r):
            return self.block_cls(cfg, r)

        self.layers = make_blocks(rngs)          # every leaf stacked: [n_layers, ...]
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.padded_vocab), ("embed", "vocab"), cfg.init_std)

    def hidden(self, tokens, positions=None, segment_ids=None):
        """tokens [b, s] -> final-normed hidden states [b, s, d]."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)  # [b, s]
        x = embed_lookup(self.embed, tokens, dt)                          # [b, s, d]
        x = constrain(x, ("act_batch", "act_seq", "act_embed"))
        block_def, block_state = nnx.split(self.layers)

        def layer(x, one_layer):  # scan body: one layer's parameters, [n_layers] axis removed
            block = nnx.merge(block_def, one_layer)
            return block(x, positions, segment_ids), None

        x, _ = layer_loop(_remat(layer, cfg.remat, not cfg.scan_layers), x, block_state, cfg)
        return self.final_norm(x)

    # -- the pieces a pipeline stage runs separately (meshlab/parallel/pipeline) ------------------
    def embed_tokens(self, tokens):
        """tokens [b, s] -> the residual stream [b, s, d] entering the first layer."""
        return self.place_stream(embed_lookup(self.embed, tokens, jnp.dtype(self.cfg.dtype)))   # [b, s, d]

    @staticmethod
    def place_stream(x):
        """x [b, s, d] laid out as the residual stream between layers."""
        return constrain(x, ("act_batch", "act_seq", "act_embed"))

    def layer_fn(self):
        """f(one layer's params, x [b, s, d], positions, segment_ids) -> x: one block, under the remat
        policy, its params a slice of `self.layers`' stacked leaves (as the layer scan's body sees them)."""
        block_def, _ = nnx.split(self.layers)

        def body(x, one_layer, positions, segment_ids):
            return nnx.merge(block_def, one_layer)(x, positions, segment_ids)
        body = _remat(body, self.cfg.remat)
        return lambda one_layer, x, positions, segment_ids: body(x, one_layer, positions, segment_ids)

    def head_loss(self, x, labels):
        """The last layer's output [b, s, d] -> final norm -> sum of the token losses (fp32 scalar)."""
        return self.loss_sum(self.final_norm(x), labels)

    def head_weight(self):
        """The output projection [d, V] in the compute dtype (the embedding, transposed, when tied)."""
        dt = jnp.dtype(self.cfg.dtype)
        if self.cfg.tie_embeddings:
            return _w(self.embed, dt).T                                   # [d, V]
        return _w(self.lm_head, dt)

    def logits(self, h):
        """h [b, s, d] -> fp32 logits [b, s, V_padded]."""
        logits = mm_f32_out("bsd,dv->bsv", h, self.head_weight())         # fp32 out for the softmax
        return constrain(logits, ("act_batch", "act_attn_seq", "act_vocab"))  # sequence gathered, as in the MLP

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.logits(self.hidden(tokens, positions, segment_ids))

    def loss_sum(self, h, labels):
        """Sum of the token losses (fp32 scalar), what training and eval reduce to. loss_impl=onepass
        computes its gradients in the forward (pallas_kernels/cross_entropy_onepass.py): one scalar
        cotangent, so no logits recomputation in the backward; the others sum token_losses."""
        if self.cfg.loss_impl != "onepass":
            return jnp.sum(self.token_losses(h, labels))
        # The sequence gathered where attention has it whole (tensor/sequence parallelism: the head
        # is vocab-parallel) and split where attention splits it (context parallelism: each device
        # its own tokens), as in `logits`. Sequence-major flattening keeps a sequence split on the
        # flat token dimension, which the kernel's strided chunks keep on every chunk.
        h = constrain(h, ("act_batch", "act_attn_seq", "act_embed"))
        b, s, d = h.shape
        flat_h = jnp.swapaxes(h, 0, 1).reshape(s * b, d)                                  # [s*b, d]
        flat_y = jnp.swapaxes(jnp.where(labels >= 0, labels, -1), 0, 1).reshape(s * b)      # [s*b]
        # A tied head goes in as the embedding itself, [V, d]: its gradient comes back [V, d], where
        # the transposed [d, V] one would be read transposed by every optimizer pass over it.
        tied = self.cfg.tie_embeddings
        weight = _w(self.embed, jnp.dtype(self.cfg.dtype)) if tied else self.head_weight()   # [V, d] | [d, V]
        return fused_ce_onepass.onepass_cross_entropy_sum(flat_h, weight, flat_y, ignore_index=-1,
                                                          chunk_size=self.cfg.loss_chunk,
                                                          logits_dtype=self.cfg.loss_logits_dtype,
                                                          softmax=_loss_softmax(self.cfg.loss_softmax),
                                                          interpret=_interpret(), vocab_major=tied)

    def token_losses(self, h, labels):
        """Cross-entropy per token [b, s] in fp32; 0 where labels < 0 (padding). loss_impl=onepass
        has no per-token form: it gives the chunked values here (training goes through loss_sum)."""
        valid = labels >= 0
        safe = jnp.where(valid, labels, 0)
        if self.cfg.loss_impl == "dense":
            logits = self.logits(h)                                       # [b, s, V]
            lse = jax.nn.logsumexp(logits, axis=-1)                       # [b, s]
            if is_split("act_vocab"):
                # The vocabulary split: the label's logit as a masked sum, each shard summing its own columns
                # and one all-reduce adding them (Megatron's vocab-parallel loss). XLA's partitioner aborts
                # on the gather when the sequence and the vocabulary are split over two axes inside the
                # step's manual region (jax 0.10, CPU). Exact: one term is the logit, the rest are 0.
                hit = jnp.arange(logits.shape[-1]) == safe[..., None]    # [b, s, V]
                label_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)   # [b, s]
            else:
                label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]   # [b, s]
            return jnp.where(valid, lse - label_logit, 0.0)
        b, s, d = h.shape
        flat_h, flat_y = h.reshape(b * s, d), jnp.where(valid, labels, -1).reshape(b * s)  # [b*s, d], [b*s]
        if self.cfg.loss_impl in ("chunked", "onepass"):
            losses = fused_ce.chunked_cross_entropy(flat_h, self.head_weight(), flat_y, ignore_index=-1)
        else:   # never holds the [b*s, V] logits (pallas_kernels/fused_cross_entropy.py)
            losses = fused_ce.fused_cross_entropy(flat_h, self.head_weight(), flat_y, ignore_index=-1,
                                                  interpret=_interpret())
        return losses.reshape(b, s)                                       # [b, s]
