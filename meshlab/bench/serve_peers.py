"""The torch peers of the serving benchmark (scripts/bench_serve.py), each run in its own process so
that torch and JAX never share one: transformers' continuous batching on the load, and at batch 1 HF
`generate` with a static cache and torch.compile and gpt-fast's compiled one-token loop. The model is a
transformers Llama of a preset's shape with random weights in bf16, as the engine serves."""
from __future__ import annotations

import time

from meshlab.bench.decode import emit


def hf_llama(preset: str = "llama3_1b", device: str = "cuda"):
    """A transformers LlamaForCausalLM of the preset's shape, random weights, bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import models
    c = models.preset(preset)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp_dim,
                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                      head_dim=c.head_dim, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
                      max_position_embeddings=131072, rms_norm_eps=c.norm_eps,
                      rope_scaling=None if not c.rope_scaling_factor else {
                          "rope_type": "llama3", "factor": c.rope_scaling_factor,
                          "low_freq_factor": c.rope_low_freq_factor, "high_freq_factor": c.rope_high_freq_factor,
                          "original_max_position_embeddings": c.rope_original_max_position})
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def peer_continuous_batching(work, label="transformers continuous batching", preset: str = "llama3_1b") -> dict:
    """transformers' own continuous batching in its default configuration, per-request max_new_tokens."""
    import torch
    from transformers import GenerationConfig
    model = hf_llama(preset)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(m for _, m in work), eos_token_id=-1)
    done, first = {}, {}
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=gen) as manager:
        t = time.perf_counter()
        ids = [manager.add_request(input_ids=p, max_new_tokens=m) for p, m in work]
        while len(done) < len(ids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    break
                continue
            first.setdefault(res.request_id, time.perf_counter())
            if res.is_finished():
                done[res.request_id] = (time.perf_counter(), len(res.generated_tokens))
        wall = time.perf_counter() - t
    out_tok = sum(n for _, n in done.values())
    return emit({"section": "peer", "setting": f"{label} n={len(work)}", "value": out_tok / wall, "unit": "tok/s",
                 "wall_s": wall, "output_tokens": out_tok, "finished": len(done),
                 "note": f"{out_tok} tokens in {wall:.1f} s, {len(done)}/{len(work)} finished; torch "
                         f"{torch.__version__}, default ContinuousBatchingConfig"})


def peer_static_b1(ctx: int = 2048, n: int = 256, preset: str = "llama3_1b") -> dict:
    """HF generate at batch 1 with a static cache and torch.compile'd forward: decode tokens/s.
    transformers >= 4.48 compiles the decode forward itself when the cache is static (its
    CompileConfig, here CUDA graphs and one graph); older ones take torch.compile on forward."""
    import torch
    import transformers
    model = hf_llama(preset)
    model.generation_config.cache_implementation = "static"
    if hasattr(transformers, "CompileConfig"):
        model.generation_config.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
        recipe = f"transformers {transformers.__version__} CompileConfig(fullgraph, reduce-overhead)"
    else:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        recipe = f"transformers {transformers.__version__} torch.compile(forward, reduce-overhead, fullgraph)"
    x = torch.randint(0, model.config.vocab_size, (1, ctx - n), device="cuda")

    def run(k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    with torch.no_grad():
        run(n), run(n), run(1)                                            # compile, capture graphs
        t1, tn = run(1), run(n)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model.generation_config.disable_compile = True                    # the same generate, eager
        run(n)
        e1, en = run(1), run(n)
    tpot, eager = (tn - t1) / (n - 1), (en - e1) / (n - 1)
    return emit({"section": "peer", "setting": f"HF generate static cache + torch.compile b=1 ctx={ctx}",
                 "value": 1 / tpot, "unit": "tok/s",
                 "note": f"TPOT {tpot * 1e3:.2f} ms from runs of 1 and {n} new tokens ({graphs} graphs compiled; "
                         f"eager generate {eager * 1e3:.2f} ms); {recipe}; torch {torch.__version__}"})


def peer_compiled_loop_b1(ctx: int = 2048, n: int = 256, preset: str = "llama3_1b") -> dict:
    """The strongest torch recipe for batch-1 latency (gpt-fast's): the HF Llama's one-token forward
    and the greedy argmax under torch.compile with CUDA graphs, over a StaticCache, in a loop that
    never reads a token back to the host (generate's per-step stopping checks do)."""
    import torch
    import torch._inductor.config as inductor
    from transformers import StaticCache
    inductor.coordinate_descent_tuning = True       # gpt-fast's settings: tuned decode kernels
    inductor.triton.unique_kernel_names = True
    inductor.fx_graph_cache = True
    model = hf_llama(preset)
    prompt = torch.randint(0, model.config.vocab_size, (1, ctx - n), device="cuda")

    def one_token(tok, pos, cache):            # [1, 1] token at position pos [1] -> the next one
        out = model(tok, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)
    step = torch.compile(one_token, mode="reduce-overhead", fullgraph=True)

    cache = StaticCache(config=model.config, max_cache_len=ctx)   # one cache: the graph keeps its addresses

    def run(k):
        cache.reset()                          # zeros, and its length count back to 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        pos = torch.arange(prompt.shape[1], device="cuda")
        tok = model(prompt, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        pos = pos[-1:] + 1
        for _ in range(k - 1):
            tok, pos = step(tok, pos, cache).clone(), pos + 1
        torch.cuda.synchronize()
        return time.perf_counter() - t
    with torch.no_grad():
        run(n), run(n)                                                    # compile, capture the graph
        t1, tn = run(1), run(n)
    tpot = (tn - t1) / (n - 1)
    return emit({"section": "peer", "setting": f"torch.compile decode loop (gpt-fast style) b=1 ctx={ctx}",
                 "value": 1 / tpot, "unit": "tok/s",
                 "note": f"TPOT {tpot * 1e3:.2f} ms from runs of 1 and {n} new tokens; HF Llama forward + argmax "
                         f"compiled (reduce-overhead, fullgraph, coordinate descent tuning), StaticCache; torch {torch.__version__}"})
