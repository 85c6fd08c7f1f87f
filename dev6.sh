#!/bin/bash
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
python3 - > $OUT/standalone.log 2>&1 <<'PY'
import jax, jax.numpy as jnp
from meshlab.train.profile_summary import summarize, format_summary
from pallas_kernels.flash_attention_mgpu import flash_attention_mgpu
b, s, h, kvh, d = 4, 4096, 32, 8, 64
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (b, s, h, d), jnp.bfloat16); k = jax.random.normal(ks[1], (b, s, kvh, d), jnp.bfloat16)
v = jax.random.normal(ks[2], (b, s, kvh, d), jnp.bfloat16); do = jax.random.normal(ks[3], (b, s, h, d), jnp.bfloat16)
impls = {"ours": lambda q, k, v: flash_attention_mgpu(q, k, v, causal=True),
         "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")}
for name, f in impls.items():
    g = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
    for _ in range(5): jax.block_until_ready(g(q, k, v, do))
    with jax.profiler.trace(f"/tmp/prof_{name}", create_perfetto_trace=True):
        for _ in range(10): out = g(q, k, v, do)
        jax.block_until_ready(out)
    print(format_summary(summarize(f"/tmp/prof_{name}", steps=10, top=12), f"standalone fwd+bwd {name}"))
PY
echo "standalone rc=$?"
cat $OUT/standalone.log | grep -v "^$" | head -60
timeout 420 python3 scripts/bench_train.py --batch 4 --no-peer --steps 6 --budget-s 300 --profile --variants \
  attention=pallas,remat=save_dots_no_batch attention=cudnn,remat=save_dots_no_batch > $OUT/train.log 2>&1
echo "train rc=$?"
grep -E "tokens_per_s" $OUT/train.log | cut -c1-200
grep -B2 -A30 "Device time per step" $OUT/profiles.md | grep -E "Device time|mosaic|Mosaic|flash|fmha|cudnn|attention|sdpa|^\| (gemm|attention|reduce|copy|other|pallas)" | head -40
