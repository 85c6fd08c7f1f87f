"""The first-token profile (meshlab/bench/first_token.py) on CPU: its timeline and dispatch variants
run against a real Engine, and the request it profiles computes only the uncached tail."""
import dataclasses

import models
from meshlab.bench.first_token import engine_tail_profile, variants_note
from meshlab.infer.engine import Engine
from meshlab.infer.loading import random_params
from models import model_def


def test_tail_profile_times_each_piece_and_every_variant(tmp_path):
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=1)
    eng = Engine(model_def(cfg), random_params(cfg), max_len=128, max_seqs=1, page_size=16, chunk=32,
                 steps_per_call=4)
    row = engine_tail_profile(eng, tmp_path / "trace", n=64, tail=16, reps=3)
    assert row["prefill_tokens"] == 16 and row["programs"] == [("packed", 0, 1, 16)]
    t = row["timeline_us"]
    pieces = ("before_dispatch", "dispatch", "device_wait", "to_first_token")
    assert all(t[k] > 0 for k in pieces) and t["ttft"] <= t["call"]     # each call's first token is within it
    for name in ("jit", "aot", "aot_nocmdbuf"):            # each variant compiled, dispatched and read back
        assert all(row[f"{name}_dispatch_{x}_us"] > 0 for x in ("numpy", "device", "reuse", "same"))
        assert row[f"{name}_call_us"] > 0
    assert row["pinned_call_us"] > 0 and row["pinned_dispatch_same_us"] > 0    # input via pinned host memory
    assert row["arg_leaves"] == len(eng.weights) + len(eng.cache) + 2 and row["put_us"] > 0   # + seen, input
    assert "aot_nocmdbuf: dispatch" in variants_note(row)
    assert "error" in row                                  # no GPU kernels to profile on CPU: said, not fatal
    assert eng.sched.pool.available == eng.sched.pool.total  # every request profiled gave its pages back
