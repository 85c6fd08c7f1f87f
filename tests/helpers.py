"""Shared set-up for the tests: a very small model and config built in-process, and the random
inputs and error measure of the attention kernel tests."""
from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
         "model.mlp_dim=64", "model.dtype=float32", "data.seq_len=32", "data.global_batch=16",
         "optim.lr=1e-2", "optim.warmup_steps=0", "sample_tokens=0", "log_every=1"]

# Mesh per shipped rule file on 8 devices (tp needs tensor <= kv_heads = 2 here).
MESH_FOR = {"dp": None, "zero1": None, "zero2": None, "fsdp": None, "tp": "data=4,tensor=2",
            "fsdp_tp": None, "fsdp_tp_sp": None, "fsdp_tp_sp_cm": None,
            # context parallel: ring with zig-zag order inside the step, and all-to-all
            "fsdp_cp": None, "cp_ring": "data=2,context=4", "cp_ulysses": "data=4,context=2"}
# Expert-parallel rule files, run with moe_tiny (tests/models/test_moe.py's parity tests).
EP_MESH = {"ep": "expert=8", "fsdp_ep": "fsdp=2,expert=4", "fsdp_tp_ep": "fsdp=2,tensor=2,expert=2"}


def small_config(rules="dp", mesh=None, steps=3, extra=(), tmp_path=None):
    # imported here: the GPU machine that runs the kernel tests has no omegaconf
    from meshlab.train.config import load_config
    over = SMALL + [f"rules={rules}", f"steps={steps}"] + list(extra)
    if mesh:
        over.append(f"mesh={mesh}")
    if tmp_path is not None:
        over.append(f"run_dir={tmp_path}")
    return load_config("default", over)


def one_device():
    return [jax.devices()[0]]


def attention_inputs(seed, b, sq, sk, h, kvh, d, dtype):
    """Random q [b, sq, h, d], k/v [b, sk, kvh, d] and dO [b, sq, h, d] in `dtype`."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, kvh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, kvh, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32).astype(dtype)
    return q, k, v, do


def rel_err(a, b):
    """||a - b|| / ||b|| in fp32; a non-finite `a` fails (an element never written, or an overflow)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), "non-finite values: an element was never written (or overflowed)"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _reset_compilation_cache():
    try:
        from jax._src import compilation_cache
        compilation_cache.reset_cache()   # the on/off decision is cached at the first compile
    except (ImportError, AttributeError):
        pass


@contextlib.contextmanager
def persistent_compile_cache(directory):
    """JAX's persistent compilation cache in `directory` for every compile, whatever its time or size
    (so a test's later process or compile of the same program reads it), restored afterwards."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    old = {n: getattr(jax.config, n) for n in names}
    for n, v in zip(names, (str(directory), 0, 0)):
        jax.config.update(n, v)
    _reset_compilation_cache()
    try:
        yield
    finally:
        for n, v in old.items():
            jax.config.update(n, v)
        _reset_compilation_cache()


@contextlib.contextmanager
def cheap_codegen():
    """Every compile inside at LLVM's cheapest code generation (jax_disable_most_optimizations: backend
    -O0 and no expensive LLVM passes), restored afterwards. The optimised HLO, its collectives and the
    buffer assignment are the same and fp32 numbers agree to rounding; a small train step compiles 2-3x
    faster on CPU and runs slower, so it suits tests whose compiles cost more than their runs."""
    old = getattr(jax.config, "values", {}).get("jax_disable_most_optimizations")
    if old is None:   # a jax without the flag: compile as usual
        yield
        return
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


def save_hf_with_perturbed_norms(model, directory):
    """A transformers model with non-trivial norm scales (so a swapped norm would show in parity),
    saved as safetensors under `directory`; the model, eval mode, float32."""
    import torch
    model = model.eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def tiny_served_model():
    """(model def, params, jitted full forward -> logits [b, s, vocab]) of the tiny model in fp32 that the
    serving tests check the engine against. init_std 0.2 spreads the logits: a random model at 0.02 is
    near-uniform and argmax ties would make the equality tests hinge on rounding."""
    import dataclasses
    from flax import nnx
    import models
    from models import model_def
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
    md = model_def(cfg)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    fwd = jax.jit(lambda p, x: md.bind(p)(x)[..., :cfg.vocab_size])
    return md, params, fwd


def assert_greedy_matches(fwd, params, prompt, output):
    """Every generated token is the argmax of the full no-cache forward over what preceded it."""
    seq = list(prompt) + list(output)
    logits = np.asarray(fwd(params, jnp.asarray([seq], jnp.int32)))[0]
    expect = logits[len(prompt) - 1:len(seq) - 1].argmax(-1).tolist()
    assert output == expect


def check_prompt_logprobs(got, prompt, ref, top, ranked=None):
    """got (Request.prompt_logprobs) against ref [n, V], the no-cache forward's log-softmax; a rank,
    present when asked for (ranked True), absent when its steps computed none (ranked False; None:
    either, as for a request sharing its steps with one that asked), within one of the reference's
    (a token within fp32 rounding of another may swap with it)."""
    assert len(got) == len(prompt) and got[0] is None
    for k in range(1, len(prompt)):
        value, alternatives, rank = got[k]
        assert ranked is None or (rank is not None) == ranked
        best = np.argsort(-ref[k - 1])[:top].tolist()
        np.testing.assert_allclose(value, ref[k - 1, prompt[k]], rtol=1e-4, atol=1e-4)
        if rank is not None:                   # asked for (SamplingParams.prompt_ranks)
            above = ref[k - 1] - ref[k - 1, prompt[k]]
            assert 1 + np.sum(above > 1e-4) <= rank <= 1 + np.sum(above > -1e-4)
        assert list(alternatives) == best
        np.testing.assert_allclose(list(alternatives.values()), ref[k - 1, best], rtol=1e-4, atol=1e-4)


def record_instances(monkeypatch, module, name: str) -> list:
    """The instances of module.<name> (a class) made while the test runs, in order: the class is
    replaced there by a subclass that records each (a script that imports it from the module gets it)."""
    made = []

    class Recorded(getattr(module, name)):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)
    monkeypatch.setattr(module, name, Recorded)
    return made


def script_module(name: str):
    """scripts/<name>.py imported as a module (the scripts are files, not a package), its main() unrun."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"{name}_script", Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
