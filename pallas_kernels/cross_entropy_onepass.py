"""Sum of softmax cross-entropy losses over tokens, with its gradients computed in the forward pass.

    onepass_cross_entropy_sum(hidden [T, d], weight [d, V], labels [T]) -> scalar fp32
        = sum_t loss_t,  loss_t = lse_t - logit_t[label_t] + z_loss * lse_t**2  (0 where ignored)

Why one pass: the training loss is a *sum* of per-token losses, so its cotangent is one scalar g
and d(sum)/dlogits = softmax - onehot does not depend on g. The forward finishes the gradient while
each chunk's logits are in hand, saves dh [T, d] and dW [d, V], and the backward only scales them.
3 logits-sized GEMMs (the minimum) against 4 for fused_cross_entropy.py's slab mode; one [N, V]
logits slab at a time. The GEMMs are jnp (cuBLAS speed; GSPMD partitions them, so a vocab-sharded
head weight is never gathered); the passes over each slab are jnp too, or softmax_rows.py's kernels
(softmax="pallas") where the arrays are local. Design and costs: `_sweep`.
Limits: no per-token output; differentiate the sum (or a scalar multiple of it).
Speed and memory against the dense loss: docs/benchmarks.md#fused-ops.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import softmax_rows
from pallas_kernels.cross_entropy_common import check_args, token_loss

F32 = jnp.float32
_TN = (((0,), (0,)), ((), ()))  # a^T @ b


def slab_passes(logits, y, ignore_index, z_loss, grads, out_dtype, softmax="xla", interpret=False):
    """Everything between a chunk's head GEMM and its gradient GEMMs: logits [n, V] (fp32 or bf16, as the
    GEMM wrote them) -> the chunk's loss sum and, with grads, dlogits [n, V] in out_dtype. The math
    is fp32 either way. softmax="pallas": two kernels (softmax_rows.py), one read of the slab for the
    statistics and one read + write for dlogits, where XLA's fusions read it 4-5 times."""
    if softmax == "pallas":
        lse, label_logit = softmax_rows.softmax_stats(logits, y, interpret=interpret)   # [n], [n]
    else:
        logits = logits.astype(F32)
        m = jnp.max(logits, axis=-1)                                         # [n]
        lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))    # [n]
        # A compare with an iota, not a gather: it partitions over a vocab-sharded V and fuses into
        # the reductions; the onehot is needed for dlogits anyway.
        hit = lax.broadcasted_iota(jnp.int32, logits.shape, 1) == y[:, None] # [n, V]
        label_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)          # [n]
    loss = jnp.sum(token_loss(lse, label_logit, y, ignore_index, z_loss))
    if not grads:
        return loss, None
    valid = y != ignore_index                                                # [n]
    cp = jnp.where(valid, 1.0 + 2.0 * z_loss * lse, 0.0)                     # d(lse + z lse^2)/d lse
    cy = valid.astype(F32)
    if softmax == "pallas":
        return loss, softmax_rows.softmax_grad(logits, lse, y, cp, cy, out_dtype=out_dtype, interpret=interpret)
    dlogits = cp[:, None] * jnp.exp(logits - lse[:, None]) - jnp.where(hit, cy[:, None], 0.0)  # [n, V]
    return loss, dlogits.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The static choices of one call (hashable: custom_vjp's one non-differentiable argument)."""
    ignore_index: int
    z_loss: float
    chunk_size: int
    weight_dtype: str
    logits_dtype: str = "float32"
    softmax: str = "xla"
    interpret: bool = False
    vocab_major: bool = False   # weight stored [V, d] (a tied embedding): dW made [V, d] too


def _chunk(h, w, y, o: _Options, grads):
    """Loss sum of one chunk h [n, d], y [n]; with grads also (dh [n, d] in h's dtype, dW part fp32, in
    the weight's layout). logits_dtype: what the head GEMM writes (fp32 accumulation either way).
    bf16 halves the bytes of the slab every pass reads; each pass upcasts in registers."""
    vd = o.vocab_major
    contract_w = ((1,), (1 if vd else 0,))
    logits = lax.dot_general(h, w, (contract_w, ((), ())), preferred_element_type=o.logits_dtype)  # [n, V]
    loss, dlogits = slab_passes(logits, y, o.ignore_index, o.z_loss, grads, w.dtype, o.softmax, o.interpret)
    if not grads:
        return loss
    dh = lax.dot_general(dlogits, w, (((1,), (0 if vd else 1,)), ((), ())),
                         preferred_element_type=F32).astype(h.dtype)                  # [n, V] x W -> [n, d]
    if vd:
        dw = lax.dot_general(dlogits, h, _TN, preferred_element_type=F32)             # [n, V]^T x [n, d] -> [V, d]
    else:
        dw = lax.dot_general(h, dlogits, _TN, preferred_element_type=F32)             # [n, d]^T x [n, V] -> [d, V]
    return loss, dh, dw


def _sweep(hidden, weight, labels, o: _Options, grads):
    """Loss sum over all chunks; with grads also (dh [T, d], dW fp32 in the weight's layout).

    Per chunk of N tokens (a loop over T // N chunks, one more call for a T % N tail):
        logits = h_c @ W             bf16 GEMM, fp32 output                          [N, V]
        lse, label logit, loss       fp32 reductions over V                          [N]
        dlogits = (1 + 2 z lse) softmax - onehot, 0 on ignored rows, in the weights' dtype: the
                                     dense model rounds its fp32 dlogits to bf16 once as well
        dh_c  = dlogits @ W^T        [N, d], written into dh
        dW   += h_c^T @ dlogits      fp32 carry [d, V]; XLA can fuse the add into the GEMM (beta=1)
    Cost beside the GEMMs: dW is read-modified-written once per chunk after the first, 2*d*V*4
    bytes, so larger chunks trade that traffic for a larger slab.
    dW comes out in the layout the weight is stored in ([V, d] for a tied embedding): the GEMM
    writes either orientation at the same cost, while a transposed gradient would be read
    transposed by every optimizer pass over it (the norm, both moments, the update).
    Chunks are strided (chunk j = tokens {j, j + n, j + 2n, ...}, n = T // N): a sharded token
    dimension (context parallelism) stays sharded inside every chunk, where contiguous chunks
    would slice across shards. There GSPMD keeps the dW carry replicated, so each chunk's partial
    dW is all-reduced over the token shards (T/N all-reduces of d*V*4 bytes where one would do)."""
    t, d = hidden.shape
    c = min(o.chunk_size, t)
    n = t // c
    main = n * c
    one = functools.partial(_chunk, o=o, grads=grads)
    # [main, d] -> [c, n, d]: column j is chunk j (strided, see the module doc); no copy of h.
    h3 = (hidden if main == t else hidden[:main]).reshape(c, n, d)           # [c, n, d]
    y2 = (labels if main == t else labels[:main]).reshape(c, n)              # [c, n]

    def take(i):
        return (lax.dynamic_index_in_dim(h3, i, axis=1, keepdims=False),     # [c, d]
                lax.dynamic_index_in_dim(y2, i, axis=1, keepdims=False))     # [c]

    if not grads:
        def add(i, acc):
            hc, yc = take(i)
            return acc + one(hc, weight, yc)
        loss = lax.fori_loop(0, n, add, jnp.zeros((), F32))
        return loss + one(hidden[main:], weight, labels[main:]) if main < t else loss

    def body(i, carry):
        loss, dh3, dw = carry
        hc, yc = take(i)
        l, dh, dw_c = one(hc, weight, yc)
        dh3 = lax.dynamic_update_index_in_dim(dh3, dh, i, axis=1)            # [c, n, d]
        return loss + l, dh3, dw + dw_c

    # Chunk 0 outside the loop starts the carries: its GEMM writes dW directly, where a zero
    # carry would cost one more fp32 [d, V] write and read (1 GB each at llama3_1b's vocab).
    h0, y0 = take(0)
    l0, dh0, dw0 = one(h0, weight, y0)
    dh3 = lax.dynamic_update_index_in_dim(jnp.zeros((c, n, d), hidden.dtype), dh0, 0, axis=1)  # [c, n, d]
    loss, dh3, dw = lax.fori_loop(1, n, body, (l0, dh3, dw0))
    dh = dh3.reshape(main, d)                                                # [main, d]
    if main < t:  # the tail: one smaller chunk, so the whole [T, d] is never padded
        l, dh_tail, dw_tail = one(hidden[main:], weight, labels[main:])
        loss, dw = loss + l, dw + dw_tail
        dh = jnp.concatenate([dh, dh_tail], axis=0)                          # [T, d]
    return loss, dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _onepass(hidden, weight, labels, o: _Options):
    # Not differentiated (eval): the loss only, one GEMM per chunk.
    return _sweep(hidden, weight, labels, o, grads=False)


def _onepass_fwd(hidden, weight, labels, o: _Options):
    loss, dh, dw = _sweep(hidden, weight, labels, o, grads=True)
    return loss, (dh, dw)


def _onepass_bwd(o: _Options, res, g):
    # Saved: dh in h's dtype (as the dense path's dh GEMM writes it) and dW in fp32: it is the loop's
    # carry, so saving it costs no extra buffer (a bf16 copy would coexist with the carry while
    # converting); it lives only from the loss forward to the head's backward, adjacent in the step.
    dh, dw = res
    g = g.astype(F32)
    # Scaled in fp32 and rounded once to the operands' dtypes; labels are integers: no cotangent.
    return (dh.astype(F32) * g).astype(dh.dtype), (dw * g).astype(o.weight_dtype), None


_onepass.defvjp(_onepass_fwd, _onepass_bwd)


def onepass_cross_entropy_sum(hidden, weight, labels, *, ignore_index=-1, z_loss=0.0, chunk_size=4096,
                              logits_dtype="float32", softmax="xla", interpret=False, vocab_major=False):
    """Sum over tokens of the softmax cross-entropy of hidden [T, d] @ weight [d, V] against
    labels [T] (0 for labels == ignore_index): a float32 scalar whose gradient the forward already
    computed (module doc). hidden and weight may be bf16 (GEMM operands, fp32 accumulation) or fp32.
    Differentiate the sum itself (any scalar multiple of it is fine): this has no per-token output.
    softmax: "xla" (jnp, partitioned by GSPMD) or "pallas" (softmax_rows.py's kernels: the caller
    sees whole arrays, e.g. one device or inside a shard_map; interpret=True runs them on the CPU).
    vocab_major: weight is stored [V, d] (a tied embedding) and used as its transpose; its gradient
    comes out [V, d] as well.
    """
    check_args(hidden, jax.ShapeDtypeStruct(weight.shape[::-1] if vocab_major else weight.shape, weight.dtype),
               labels, ignore_index, z_loss)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{chunk_size=} must be a positive int (tokens per [chunk_size, V] logits slab)")
    if logits_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{logits_dtype=} must be 'float32' or 'bfloat16' (what the head GEMM writes)")
    if softmax not in ("xla", "pallas"):
        raise ValueError(f"{softmax=} must be 'xla' or 'pallas' (how the passes over the logits slab run)")
    return _onepass(hidden, weight, labels, _Options(int(ignore_index), float(z_loss), chunk_size,
                                                     jnp.dtype(weight.dtype).name, logits_dtype, softmax,
                                                     bool(interpret), bool(vocab_major)))
