"""fp8 storage in the serving engine on CPU: fp8 weights (weight-only decode, FP8 GEMMs on prompt
chunks) and an fp8 KV cache against the full forward over what they stand for."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.infer.engine import ContiguousGenerator, Engine
from meshlab.infer.sampler import SamplingParams
from tests.helpers import assert_greedy_matches, check_prompt_logprobs, tiny_served_model

pytestmark = [pytest.mark.xdist_group("infer_engine"), pytest.mark.cheap_codegen]


@pytest.fixture(scope="module")
def tiny():
    return tiny_served_model()


def dequantized_fp8(params):
    """The tiny model's params with each decoder matrix replaced by its fp8 rows times their scales, per
    output (decode_gemv.quantize_rows over the contraction axis): the model an fp8 engine serves."""
    from pallas_kernels.decode_gemv import quantize_rows

    def round_trip(w, k_axes):                     # one layer's matrix, its contraction over the first k_axes
        shape = w.shape
        nk = w.reshape(int(np.prod(shape[:k_axes])), -1).T                                     # [n, k]
        q, scale = quantize_rows(nk)
        return (q.astype(jnp.float32) * scale[:, None]).T.reshape(shape).astype(w.dtype)
    layers = params["layers"]
    attn = {n: jax.vmap(lambda w, n=n: round_trip(w, 2 if n == "wo" else 1))(v) if n in ("wq", "wk", "wv", "wo") else v
            for n, v in layers["attn"].items()}
    mlp = {n: jax.vmap(lambda w: round_trip(w, 1))(v) if n in ("w_gate", "w_up", "w_down") else v
           for n, v in layers["mlp"].items()}
    return dict(params, layers=dict(layers, attn=attn, mlp=mlp))


def test_fp8_weights_serve_the_dequantized_model(tiny):
    """quantize="fp8": the layers' matrices stored float8_e4m3fn with a scale per output row (half the
    bytes), the tokens the greedy argmax of the full forward over the dequantized weights, prompt
    chunks and decode steps alike; the embedding stays in the compute dtype. fp8 needs kernels layers
    and a dense model."""
    md, params, fwd = tiny
    # one row: decode steps of one token (_mm_decode's zero second row), prompt chunks of several
    eng = Engine(md, params, max_len=64, max_seqs=1, page_size=4, chunk=8, steps_per_call=4, quantize="fp8")
    assert eng.layers == "kernels"
    mats = eng.params["layers"][0][1]["decode"]
    assert mats["wqkv_t"].dtype == jnp.float8_e4m3fn and mats["w_gate_up_t_scale"].shape == mats["w_gate_up_t"].shape[:-1]
    assert eng.params["embed"].dtype == jnp.float32
    deq = dequantized_fp8(params)
    prompts = [[5, 6, 7], list(range(20, 39))]
    for r in eng.generate(prompts, SamplingParams(max_tokens=9)):
        assert_greedy_matches(fwd, deq, r.prompt, r.output)
    with pytest.raises(ValueError, match="needs layers='kernels'"):
        Engine(md, params, max_len=64, max_seqs=1, page_size=4, layers="fused", quantize="fp8")
    with pytest.raises(ValueError, match="must be None or 'fp8'"):
        Engine(md, params, max_len=64, max_seqs=1, page_size=4, layers="kernels", quantize="int4")


def test_fp8_weights_in_the_contiguous_generator_serve_the_dequantized_model(tiny):
    """ContiguousGenerator(quantize="fp8") (generate.py --quantize fp8): the same fp8 matrices as
    Engine's, its greedy tokens the dequantized model's; a sharded mesh is refused as Engine refuses it."""
    md, params, fwd = tiny
    gen = ContiguousGenerator(md, params, batch=1, max_len=64, chunk=16, quantize="fp8")
    assert gen.params["layers"][0][1]["decode"]["wqkv_t"].dtype == jnp.float8_e4m3fn
    prompt = list(range(20, 39))
    assert_greedy_matches(fwd, dequantized_fp8(params), prompt, gen.generate([prompt], SamplingParams(max_tokens=9))[0])
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match="serves a dense model on one device"):
        ContiguousGenerator(md, params, batch=2, max_len=64, chunk=16, mesh=mesh, quantize="fp8")


def _e4m3_rows(x):
    """numpy: each row (over the last axis) of x rounded to e4m3 at its own scale amax / 448, in float64."""
    import ml_dtypes
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / 448.0, 1.0)
    return np.asarray((x / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn), np.float64) * scale


@pytest.mark.parametrize("spec, x_shape, w_shape", [("bsd,nd->bsn", (2, 8, 32), (48, 32)),
                                                     ("bsd,gfd->bsgf", (1, 16, 32), (2, 24, 32))])
def test_fp8_gemm_quantizes_each_token_from_the_row_limit(monkeypatch, spec, x_shape, w_shape):
    """fp8 matrices at FP8_GEMM_ROWS tokens or more: one FP8 GEMM over each token's activations rounded
    to e4m3 at its own scale (tokens 2^12 apart in size: one scale for all would flush the small ones
    to subnormals); below the limit, the matrix widened and the activations exact."""
    from models import serving
    from pallas_kernels.decode_gemv import quantize_rows
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    sizes = 2.0 ** (np.arange(x_shape[0] * x_shape[1]) % 13).reshape(x_shape[:2] + (1,))
    x = jax.random.normal(kx, x_shape, jnp.float32) * sizes                            # [b, t, k]
    wq, w_scale = quantize_rows(jax.random.normal(kw, w_shape, jnp.float32))
    w = np.asarray(wq, np.float64) * np.asarray(w_scale, np.float64)[..., None]       # what the fp8 rows stand for
    w8a8, w8a16 = np.einsum(spec, _e4m3_rows(x), w), np.einsum(spec, np.asarray(x, np.float64), w)
    rows = x_shape[0] * x_shape[1]

    def gemm(limit):                # (the product, the dot's operand types as lowered: fp8 ones make an FP8 GEMM)
        monkeypatch.setattr(serving, "FP8_GEMM_ROWS", limit)
        f = jax.jit(functools.partial(serving._mm_decode, spec))
        dots = [line for line in f.lower(x, wq, w_scale).as_text().splitlines() if "dot_general" in line]
        return np.asarray(f(x, wq, w_scale)), [line.split(" : ")[-1].split(" -> ")[0] for line in dots]
    got, operands = gemm(rows)
    np.testing.assert_allclose(got, w8a8, rtol=1e-5, atol=1e-5 * np.abs(w8a8).max())
    assert np.abs(got - w8a16).max() > 1e-3 * np.abs(w8a16).max()          # the activations were rounded
    assert len(operands) == 1 and operands[0].count("f8E4M3FN") == 2       # both operands fp8 into the dot
    got, operands = gemm(rows + 1)
    np.testing.assert_allclose(got, w8a16, rtol=1e-5, atol=1e-5 * np.abs(w8a16).max())
    assert len(operands) == 1 and "f8E4M3FN" not in operands[0]


def test_fp8_prompt_gemms_serve_the_dequantized_model_over_rounded_activations(tiny, monkeypatch):
    """Prompt chunks through FP8 GEMMs (the row limit lowered to the tiny model's chunks): every prompt
    token's logprob is the full forward's over the dequantized weights with each projection's input
    token rounded to e4m3 at its own scale, and not the forward's with exact activations."""
    import models.llama as llama
    from models import serving
    md, params, _ = tiny
    monkeypatch.setattr(serving, "FP8_GEMM_ROWS", 1)
    eng = Engine(md, params, max_len=64, max_seqs=1, page_size=4, chunk=8, steps_per_call=4, quantize="fp8")
    deq = dequantized_fp8(params)

    def reference(round_activations):
        def rounded(spec, x, w):                    # x [b, s, ...]: each token's values at its own scale, then exact
            tokens = x.reshape(x.shape[:2] + (-1,))
            amax = jnp.max(jnp.abs(tokens), axis=-1, keepdims=True)
            scale = jnp.where(amax > 0, amax / 448.0, 1.0)
            return llama._mm(spec, ((tokens / scale).astype(jnp.float8_e4m3fn).astype(x.dtype) * scale).reshape(x.shape), w)
        mm = rounded if round_activations else llama._mm
        with monkeypatch.context() as m:
            m.setattr(llama, "_layer_mm", lambda cfg: mm)
            logits = md.bind(deq)(jnp.asarray([prompt], jnp.int32))[0, :, :md.cfg.vocab_size]
        return np.asarray(jax.nn.log_softmax(logits, axis=-1))
    prompt = np.random.default_rng(5).integers(0, md.cfg.vocab_size, 19).tolist()     # chunks of 8, 8 and 3
    got = eng.prompt_logprobs(prompt, top=2)
    check_prompt_logprobs(got, prompt, reference(True), 2)
    exact = reference(False)
    assert max(abs(got[k][0] - exact[k - 1, prompt[k]]) for k in range(1, len(prompt))) > 1e-3


def test_fp8_engine_compiles_its_packed_programs_with_the_quantized_options(tiny, monkeypatch):
    """A quantized engine's packed programs take FP8_PACKED_OPTIONS under the caller's own packed options;
    a bf16 engine's take only the caller's."""
    from meshlab.infer import calls, engine as engine_mod
    md, params, _ = tiny
    seen, real = [], calls.packed_program
    monkeypatch.setattr(calls, "packed_program", lambda fn, treedef, opts=None, *a: seen.append(opts) or real(fn, treedef, opts, *a))
    mine = {"xla_gpu_enable_command_buffer": ""}
    for quantize in ("fp8", None):
        Engine(md, params, max_len=32, max_seqs=1, page_size=4, chunk=8, quantize=quantize, compiler_options={"packed": mine})
    assert seen == [{**engine_mod.FP8_PACKED_OPTIONS, **mine}, mine]


def test_fp8_weights_refuse_a_gpu_without_fp8_tensor_cores(tiny, monkeypatch):
    """quantize="fp8" on a GPU below compute capability 8.9 (an A100) stops with one error that names the
    card and what to do; Hopper and a CPU pass."""
    import types
    from meshlab.infer.programs import check_fp8_devices
    gpu = lambda kind, cc: types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)  # noqa: E731
    check_fp8_devices([gpu("NVIDIA H100 80GB HBM3", "9.0"), gpu("NVIDIA L4", "8.9")] + jax.devices("cpu"))
    with pytest.raises(ValueError, match=r"compute capability 8.9 or more .* NVIDIA A100-SXM4-80GB is 8.0: serve it in bf16"):
        check_fp8_devices([gpu("NVIDIA A100-SXM4-80GB", "8.0")])
    md, params, _ = tiny
    monkeypatch.setattr(jax, "devices", lambda *a: [gpu("NVIDIA A100-SXM4-80GB", "8.0")])
    with pytest.raises(ValueError, match="compute capability 8.9"):
        Engine(md, params, max_len=32, max_seqs=1, page_size=4, quantize="fp8")


def test_fp8_kv_cache_serves_the_model_over_fp8_keys_and_values(tiny):
    """kv_cache_dtype="fp8": the paged cache in float8_e4m3fn. Each greedy token equals the next token
    of the whole sequence in one prompt pass over a contiguous fp8 cache (every K/V rounded to fp8 as
    written, attention in the model's dtype), prompt chunks and decode steps alike; the same pass over
    the model-dtype cache gives other tokens, so the check tells the two apart."""
    md, params, _ = tiny
    eng = Engine(md, params, max_len=64, max_seqs=2, page_size=4, chunk=8, steps_per_call=4, kv_cache_dtype="fp8")
    assert eng.cache["k"].dtype == jnp.float8_e4m3fn and eng.cache["v"].dtype == jnp.float8_e4m3fn
    whole = {kv: ContiguousGenerator(md, params, batch=1, max_len=64, chunk=64, kv_cache_dtype=kv) for kv in ("fp8", "auto")}

    def next_tokens(kv, prompt, output):       # the greedy next token after each prefix, each in one pass
        seq = list(prompt) + list(output)
        return [whole[kv].generate([seq[:n]], SamplingParams(max_tokens=1))[0][0] for n in range(len(prompt), len(seq))]
    differs = 0
    for r in eng.generate([[5, 6, 7], list(range(20, 39)), list(range(60, 100, 3))], SamplingParams(max_tokens=9)):
        assert r.output == next_tokens("fp8", r.prompt, r.output)
        differs += r.output != next_tokens("auto", r.prompt, r.output)
    assert differs
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' must be one of auto, fp8"):
        Engine(md, params, max_len=64, max_seqs=1, page_size=4, kv_cache_dtype="int8")


def test_the_weights_line_counts_the_fp8_matrices_apart(tiny):
    """serve.py's start line (programs.weights_summary): an fp8 engine's decoder matrices, one byte an
    element, stated apart from the fp32 rest (embedding, norms, the matrices' scales)."""
    from meshlab.infer.programs import weights_summary
    md, params, _ = tiny
    cfg = md.cfg
    eng = Engine(md, params, max_len=32, max_seqs=1, page_size=4, chunk=8, quantize="fp8")
    per_layer = cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * cfg.d_model \
        + 3 * cfg.mlp_dim * cfg.d_model                                      # q|k|v, wo, gate|up, down
    rest = sum(a.size * 4 for a in jax.tree.leaves(eng.params) if a.dtype == jnp.float32)
    mib = lambda b: f"{b / 2 ** 20:.1f} MiB"  # noqa: E731
    fp8 = cfg.n_layers * per_layer
    parts = sorted([(fp8, "float8_e4m3fn"), (rest, "float32")], reverse=True)
    assert weights_summary(eng.params) == f"weights: {mib(fp8 + rest)} (" + ", ".join(f"{mib(b)} {n}" for b, n in parts) + ")"
