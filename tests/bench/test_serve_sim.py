"""bench_serve's simulated device: the engine's own host path runs against a modeled device."""
import dataclasses
import time

import models
from meshlab.bench.serve import SimulatedDevice, workload
from meshlab.infer.engine import Engine
from meshlab.infer.loading import random_params
from meshlab.infer.sampler import SamplingParams
from models import model_def


def test_simulated_device_paces_the_engine_and_its_tokens_reach_the_requests():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=1)
    eng = Engine(model_def(cfg), random_params(cfg), max_len=64, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)
    SimulatedDevice(eng, step_s=2e-3, row_s=0.0, packed_s=2e-3, token_s=0.0, dispatch_s=0.0, vocab=cfg.vocab_size)
    work = workload(6, prompt=(4, 20), output=(5, 12), vocab=cfg.vocab_size)
    t = time.perf_counter()
    reqs = eng.generate([p for p, _ in work], [SamplingParams(max_tokens=m, logprobs=0) for _, m in work])
    wall = time.perf_counter() - t
    assert [len(r.output) for r in reqs] == [m for _, m in work]
    assert all(len(r.logprobs) == len(r.output) and all(lp <= 0 for lp, _ in r.logprobs) for r in reqs)
    # one device timeline: every step (a decode step, or a packed step) took its 2 ms after the last
    assert wall >= eng.stats["steps"] * 2e-3 and eng.stats["device_wait_s"] > 0


def test_overlap_ab_alternates_the_modes_and_compares_their_tokens():
    """bench_serve's overlap_ab job: the offline load with steps overlapped and read back one by one,
    alternated in one engine, then the two modes' greedy tokens on the same prompts (equal in float32)."""
    import dataclasses
    import models
    from meshlab.bench import serve as bs
    from meshlab.infer.engine import Engine
    from meshlab.infer.loading import random_params
    from models import model_def
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=1)
    eng = Engine(model_def(cfg), random_params(cfg), max_len=64, max_seqs=4, page_size=4, chunk=16, steps_per_call=4)
    work = bs.workload(10, prompt=(8, 40), output=(4, 16), vocab=cfg.vocab_size)
    rows = bs.overlap_ab(eng, work, cfg.vocab_size)
    runs, same = rows[:-1], rows[-1]
    assert [r["setting"].split("=")[1][:4] for r in runs] == ["Fals", "True", "True", "Fals"]
    assert all((r["overlapped_calls"] > 0) == ("True" in r["setting"]) for r in runs)
    assert all(r["output_tokens"] == sum(m for _, m in work) for r in runs)
    assert same["value"] == 1.0 and not eng.has_work()
    assert eng.overlap_steps and eng.sched.pool.prefix_cache          # the engine as it came
