"""Attention dispatch: availability per platform, auto's order and log, explicit-choice errors, and
every implementation agreeing with the float32 reference where it can run."""
import logging

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import attention
from pallas_kernels.flash_attention import flash_attention_reference
from tests.helpers import rel_err as _rel

# Compiling dominates (tiny shapes): cheap_codegen, CPU only (the GPU cases are unaffected).
pytestmark = pytest.mark.cheap_codegen

@pytest.fixture(autouse=True)
def _fresh_auto(monkeypatch):
    monkeypatch.setattr(attention, "_auto_choice", None)
    monkeypatch.setattr(attention, "_logged_fallback", set())


def _qkv(sq=32, sk=32, h=4, kvh=2, d=64, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(ks[0], (2, sq, h, d)).astype(dtype),
            jax.random.normal(ks[1], (2, sk, kvh, d)).astype(dtype),
            jax.random.normal(ks[2], (2, sk, kvh, d)).astype(dtype))




def test_cpu_availability():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU-only expectations")
    assert attention.available("xla") and attention.available("auto")
    assert not attention.available("pallas") and not attention.available("cudnn")


def test_auto_picks_first_available_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(attention, "available", lambda i: i in ("cudnn", "xla", "auto"))
    monkeypatch.setattr(attention, "on_hopper", lambda: True)   # pallas first, but not available here
    with caplog.at_level(logging.INFO, logger=attention.log.name):
        assert attention.resolve("auto") == "cudnn"
        assert attention.resolve("auto") == "cudnn"
    assert [r.getMessage() for r in caplog.records].count("attention: auto chose cudnn") == 1
    monkeypatch.setattr(attention, "_auto_choice", None)
    monkeypatch.setattr(attention, "available", lambda i: True)
    monkeypatch.setattr(attention, "on_hopper", lambda: True)
    assert attention.resolve("auto") == "pallas"


@pytest.mark.parametrize("hopper,gpu,order", [(True, True, ("pallas", "cudnn", "xla")),
                                              (False, True, ("cudnn", "pallas", "xla")),
                                              (False, False, ("xla",))])
def test_auto_order_is_the_measured_one_per_platform(monkeypatch, hopper, gpu, order):
    """Hopper: the Mosaic kernel first; other GPUs: cuDNN before the (slower there) Triton kernel; CPU: xla."""
    monkeypatch.setattr(attention, "on_hopper", lambda: hopper)
    monkeypatch.setattr(attention, "_gpu_available", lambda: gpu)
    assert attention.auto_order() == order
    monkeypatch.setattr(attention, "available", lambda i: True)
    assert attention.resolve("auto") == order[0]


def test_explicit_unavailable_choice_is_an_error(monkeypatch):
    monkeypatch.setattr(attention, "available", lambda i: i in ("xla", "auto"))
    with pytest.raises(RuntimeError, match="'pallas' is not available"):
        attention.resolve("pallas")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        attention.resolve("flash")


def test_auto_steps_past_pallas_for_shapes_it_refuses(monkeypatch, caplog):
    monkeypatch.setattr(attention, "available", lambda i: i in ("pallas", "xla", "auto"))
    monkeypatch.setattr(attention, "auto_order", lambda: ("pallas", "cudnn", "xla"))
    q, k, v = _qkv(d=48)
    with caplog.at_level(logging.INFO, logger=attention.log.name):
        out = attention.dot_product_attention(q, k, v, impl="auto", causal=True)
    assert "pallas kernel does not take it" in caplog.text
    assert _rel(out, flash_attention_reference(q, k, v, causal=True)) < 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_xla_matches_reference_with_gqa_segments_and_chunked_prefill(causal):
    q, k, v = _qkv(sq=16, sk=32)
    seg = (jnp.zeros((2, 16), jnp.int32).at[:, 8:].set(1), jnp.zeros((2, 32), jnp.int32).at[:, 20:].set(1))
    out = attention.dot_product_attention(q, k, v, impl="xla", causal=causal, segment_ids=seg)
    ref = flash_attention_reference(q, k, v, causal=causal, segment_ids=seg)
    assert out.dtype == q.dtype and _rel(out, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_auto_is_pallas_and_all_impls_agree():
    assert attention.available("pallas") and attention.resolve("auto") == "pallas"
    q, k, v = _qkv(sq=512, sk=512, h=8, kvh=2, d=128)
    ref = flash_attention_reference(q, k, v, causal=True)
    for impl in ("xla", "cudnn", "pallas", "auto"):
        f = jax.jit(lambda q, k, v, impl=impl: attention.dot_product_attention(q, k, v, impl=impl, causal=True))
        out = f(q, k, v)
        assert _rel(out, ref) < 1e-2, impl
    seg = jnp.zeros((2, 512), jnp.int32).at[:, 300:].set(1)
    out = attention.dot_product_attention(q, k, v, impl="pallas", causal=True, segment_ids=seg)
    assert _rel(out, flash_attention_reference(q, k, v, causal=True, segment_ids=seg)) < 1e-2


def test_pallas_runs_the_mosaic_kernel_on_hopper_for_shapes_it_takes(monkeypatch):
    import pallas_kernels.flash_attention_mgpu as mgpu
    calls = []
    monkeypatch.setattr(attention, "on_hopper", lambda: True)
    monkeypatch.setattr(attention, "available", lambda impl: True)
    monkeypatch.setattr(mgpu, "flash_attention_mgpu", lambda q, k, v, **kw: calls.append(kw) or q)
    q, k, v = _qkv(sq=256, sk=256)
    attention.dot_product_attention(q, k, v, impl="pallas", causal=True)
    assert calls == [{"causal": True, "sm_scale": None}]
    assert attention.mgpu_supports(q, k)
    # packed documents, chunked prefill, lengths off the 128-row blocks, fp32, head_dim 32: Triton kernel
    assert not attention.mgpu_supports(q, k, segment_ids=jnp.zeros((2, 256), jnp.int32))
    assert not attention.mgpu_supports(*_qkv(sq=128, sk=256)[:2])
    assert not attention.mgpu_supports(*_qkv(sq=200, sk=200)[:2])
    assert not attention.mgpu_supports(*_qkv(sq=256, sk=256, dtype=jnp.float32)[:2])
    assert not attention.mgpu_supports(*_qkv(sq=256, sk=256, d=32)[:2])
