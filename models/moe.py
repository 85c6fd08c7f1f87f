"""Mixture-of-experts decoder (Mixtral / DeepSeek-MoE / Qwen-MoE style), top to bottom: config,
router, MoE feed-forward, block, model. Attention, norms, the shared expert's SwiGLU, the head and
the losses are Llama's (models/llama.py); only the feed-forward differs.

Each layer's router (fp32) scores E experts per token (softmax or sigmoid), keeps the top k with
weights normalised to sum 1, and the token's output is the weighted sum of those experts' SwiGLU
outputs, plus an always-on shared expert if configured. Where the experts run and how tokens
reach them is meshlab/parallel/experts.py's (the rule file's `experts` axes and
`strategies.experts`: dropless or capacity). Two router losses keep the experts in use, both
computed per row of the batch so that no mesh changes them: the load-balancing loss
E * sum_e f_e P_e (f_e: share of the row's assignments to e, P_e: the row's mean router
probability of e; 1 when uniform) and the z-loss mean(logsumexp(logits)^2). Their weighted sum
joins the training loss (meshlab/train/step.py).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshlab.parallel import experts as dispatch_mod
from meshlab.rules import constrain
from models.llama import (F32, MLP, Attention, Llama, LlamaConfig, RMSNorm, _layer_mm, _mm, _param, _w, embed_lookup,
                          layer_loop)
from models.remat import remat as _remat


@dataclasses.dataclass
class MoeConfig(LlamaConfig):
    name: str = "moe_tiny"
    mlp_dim: int = 0                      # no dense MLP: the feed-forward is the experts (+ shared)
    n_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 64              # each expert's SwiGLU width
    shared_mlp_dim: int = 0               # width of the always-on shared expert (0: none)
    router_score: str = "softmax"         # softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
    norm_topk: bool = True                # top-k weights renormalised to sum 1
    aux_loss_weight: float = 0.01         # load-balancing loss weight (Switch: 1e-2)
    z_loss_weight: float = 1e-3           # router z-loss weight (ST-MoE: 1e-3)
    gemm: str = "auto"                    # grouped GEMM: auto (triton on GPUs, else xla) | mosaic (Hopper) | triton | xla

    SIZES = tuple(k for k in LlamaConfig.SIZES if k != "mlp_dim")      # the experts are the feed-forward

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and model.n_experts={self.n_experts}; "
                             "lower top_k or add experts")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"model.router_score={self.router_score!r} must be softmax or sigmoid")
        if self.expert_mlp_dim < 1 or self.shared_mlp_dim < 0:
            raise ValueError(f"model.expert_mlp_dim={self.expert_mlp_dim} must be >= 1 and "
                             f"model.shared_mlp_dim={self.shared_mlp_dim} >= 0")
        if self.gemm not in ("auto", "mosaic", "triton", "xla"):
            raise ValueError(f"model.gemm={self.gemm!r} must be auto, mosaic, triton or xla")

    # -- counts (the planner, MFU and explain read these) ------------------------------------------
    @property
    def active_mlp_dim(self) -> int:
        """SwiGLU width one token runs through: k experts plus the shared one."""
        return self.top_k * self.expert_mlp_dim + self.shared_mlp_dim

    def _attention_params(self) -> int:
        return self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)

    def matmul_param_count(self, active: bool = True) -> int:
        """N of the 6N rule: the matmul weights one token uses (active) or all of them; the router
        and the LM head included (again when tied), norms and the embedding lookup excluded."""
        d = self.d_model
        width = self.active_mlp_dim if active else self.n_experts * self.expert_mlp_dim + self.shared_mlp_dim
        per_layer = self._attention_params() + 3 * d * width + d * self.n_experts
        return self.n_layers * per_layer + d * self.padded_vocab

    def param_count(self) -> dict:
        """Stored parameters, total and active per token (embedding and norms included)."""
        extra = self.padded_vocab * self.d_model * (1 if self.tie_embeddings else 2) - self.d_model * self.padded_vocab
        norms = self.d_model * (2 * self.n_layers + 1)
        return {"total": self.matmul_param_count(active=False) + extra + norms,
                "active": self.matmul_param_count(active=True) + extra + norms}

    def train_flops_per_token(self, seq_len: int) -> float:
        """6N over the active weights + causal attention 6*L*S*h*hd (DESIGN.md, Measuring)."""
        return 6.0 * self.matmul_param_count(True) + 6.0 * self.n_layers * seq_len * self.n_heads * self.head_dim


_LLAMA_1B = dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                 rope_theta=500000.0, rope_scaling_factor=32.0, tie_embeddings=True)
PRESETS = {
    # CPU tests: 8 experts (divisible by an expert axis of 2, 4 or 8), top-2, a shared expert.
    "moe_tiny": MoeConfig(n_layers=2, shared_mlp_dim=32),
    # llama3_1b's attention and active SwiGLU width (2 x 4096 = its 8192): ~1.24B active, ~3.6B total;
    # training state 16 B x 3.6B = 58 GB on one H200.
    "moe_1b_8e": MoeConfig(name="moe_1b_8e", n_experts=8, top_k=2, expert_mlp_dim=4096, **_LLAMA_1B),
    # 16 experts of 2048, top-2: ~0.84B active, ~3.6B total (16 x 4096 would be 6.9B: 102 GiB of state)
    "moe_1b_16e": MoeConfig(name="moe_1b_16e", n_experts=16, top_k=2, expert_mlp_dim=2048, **_LLAMA_1B),
    # fine-grained (DeepSeek-MoE): 64 experts of 512, top-8, one shared expert of 4096: active width
    # 8 x 512 + 4096 = 8192 again; ~4.1B total, 66 GB of state.
    "moe_1b_64e": MoeConfig(name="moe_1b_64e", n_experts=64, top_k=8, expert_mlp_dim=512, shared_mlp_dim=4096,
                            **_LLAMA_1B),
}


# -- router -------------------------------------------------------------------------------------
def route(cfg: MoeConfig, x, w_router):
    """x [b, s, d], w_router [d, E] fp32 -> logits [b, s, E], probabilities [b, s, E], top-k
    (weights [b, s, k] fp32, expert ids [b, s, k])."""
    logits = jnp.einsum("bsd,de->bse", x.astype(F32), w_router)              # [b, s, E] fp32
    if cfg.router_score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)             # for the balance loss
    top_w, top_i = jax.lax.top_k(scores, cfg.top_k)                          # [b, s, k]
    if cfg.norm_topk:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return logits, probs, top_w, top_i


def router_stats(cfg: MoeConfig, logits, probs, top_i, keep) -> dict:
    """Sums over this device's rows: load-balancing and z-loss per row, assignments per expert, drops."""
    E, (_, s, k) = cfg.n_experts, top_i.shape
    onehot = jax.nn.one_hot(top_i, E, dtype=F32)                             # [b, s, k, E]
    share = jnp.sum(onehot, axis=(1, 2)) / (s * k)                           # [b, E] f_e per row
    balance = E * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)          # [b]
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2, axis=-1)           # [b]
    return {"balance": jnp.sum(balance), "z": jnp.sum(z), "counts": jnp.sum(onehot, axis=(0, 1, 2)),  # counts [E]
            "dropped": jnp.sum(1.0 - keep.astype(F32))}


# -- layers --------------------------------------------------------------------------------------
class MoeFFN(nnx.Module):
    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        E, d, f = cfg.n_experts, cfg.d_model, cfg.expert_mlp_dim
        self.router = _param(rngs, (d, E), ("embed", None), cfg.init_std)      # replicated: every device routes
        self.w_gate = _param(rngs, (E, d, f), ("experts", "embed", "mlp"), cfg.init_std)
        self.w_up = _param(rngs, (E, d, f), ("experts", "embed", "mlp"), cfg.init_std)
        self.w_down = _param(rngs, (E, f, d), ("experts", "mlp", "embed"), cfg.init_std / math.sqrt(2 * cfg.n_layers))
        if cfg.shared_mlp_dim:
            self.shared = MLP(dataclasses.replace(cfg, mlp_dim=cfg.shared_mlp_dim), rngs)
        self.cfg = cfg

    def __call__(self, x, shared_mm=_mm):
        """x [b, s, d] (normed) -> (output [b, s, d], router_stats). shared_mm: the shared expert's GEMM
        (the training block's `_layer_mm`: FP8 under matmul_dtype=float8, as a dense MLP's; by default the
        compute dtype, as serving runs it)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        b, s, _ = x.shape
        logits, probs, top_w, top_i = route(cfg, x, _w(self.router, F32))
        mode = dispatch_mod.settings()
        pos = dispatch_mod.queue_positions(top_i, cfg.n_experts)                  # [b, s, k]
        capacity = dispatch_mod.row_capacity(s, cfg.top_k, cfg.n_experts, mode["capacity_factor"])
        keep = pos < capacity if mode["dispatch"] == "capacity" else jnp.ones_like(pos, bool)
        weights = tuple(_w(w, dt) for w in (self.w_gate, self.w_up, self.w_down))  # [E, d, f] x2, [E, f, d]
        y = dispatch_mod.moe_ffn(x, (top_i, top_w, keep, pos), weights, dispatch=mode["dispatch"],
                                 capacity=capacity, backend=cfg.gemm, chunks=mode["chunks"])  # [b, s, d]
        if cfg.shared_mlp_dim:
            y = y + self.shared(x, shared_mm)
        y = constrain(y, ("act_batch", "act_seq", "act_embed"))
        return y, router_stats(cfg, logits, probs, top_i, keep)


class MoeBlock(nnx.Module):
    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.moe = MoeFFN(cfg, rngs)

    def __call__(self, x, positions, segment_ids):  # x [b, s, d] -> (x, router stats)
        with jax.named_scope("attention"):
            attn_out = self.attn(self.attn_norm(x), positions, segment_ids)
        normed, x = self.mlp_norm(attn_out, residual=x)
        x = constrain(x, ("act_batch", "act_seq", "act_embed"))
        with jax.named_scope("moe"):
            y, stats = self.moe(normed, shared_mm=_layer_mm(self.moe.cfg))
        return constrain(x + y, ("act_batch", "act_seq", "act_embed")), stats


# -- the model -------------------------------------------------------------------------------------
class MoeLM(Llama):
    """Llama's embedding, head and losses over MoE blocks; served by models/serving.py (the experts
    are the block's feed-forward there too)."""
    block_cls = MoeBlock

    def hidden_and_aux(self, tokens, positions=None, segment_ids=None):
        """tokens [b, s] -> (final-normed hidden [b, s, d], router terms). The router terms are sums
        over this call's rows, averaged over layers: {"loss": the weighted router loss to add to the
        training loss once divided by the global row count, "balance", "z", "counts" [E], "dropped"}."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)  # [b, s]
        x = constrain(embed_lookup(self.embed, tokens, dt), ("act_batch", "act_seq", "act_embed"))
        block_def, block_state = nnx.split(self.layers)

        def layer(x, one_layer):
            return nnx.merge(block_def, one_layer)(x, positions, segment_ids)

        x, stats = layer_loop(_remat(layer, cfg.remat, not cfg.scan_layers), x, block_state, cfg)   # stats: [n_layers, ...]
        aux = {k: jnp.mean(v, axis=0) for k, v in stats.items()}                # per layer, averaged
        aux["loss"] = cfg.aux_loss_weight * aux["balance"] + cfg.z_loss_weight * aux["z"]
        return self.final_norm(x), aux

    def hidden(self, tokens, positions=None, segment_ids=None):
        return self.hidden_and_aux(tokens, positions, segment_ids)[0]

    def layer_fn(self):
        """Pipeline stages run one layer at a time and carry no router terms between stages yet."""
        raise NotImplementedError("a mixture-of-experts model does not run under a pipeline rule file yet "
                                  "(stage > 1); use ep, fsdp_ep or fsdp_tp_ep")


def aux_metrics(aux: dict, rows: int) -> dict:
    """Step metrics from router terms summed over the global batch of `rows` rows (and micro-batches)."""
    counts = aux["counts"]                                                   # [E] assignments per layer
    mean = jnp.mean(counts)
    return {"moe_balance_loss": aux["balance"] / rows, "moe_z_loss": aux["z"] / rows,
            "moe_tokens_min": jnp.min(counts), "moe_tokens_max": jnp.max(counts),
            "moe_tokens_cv": jnp.std(counts) / jnp.maximum(mean, 1e-9),
            "moe_dropped_frac": aux["dropped"] / jnp.maximum(jnp.sum(counts), 1.0)}
