"""The torch peers of scripts/bench_scaling.py: transformers' Llama at the llama3_1b shape (the model
config of bench_train_torch.py), torch.compile + AMP bf16 + fused AdamW, under DDP and under FSDP2
(`torch.distributed.fsdp.fully_shard`) on 1 and N GPUs of one host, one process per GPU (spawned
here, localhost rendezvous), plus torch NCCL bus bandwidth of all-reduce / all-gather /
reduce-scatter. One JSON line per run on stdout; a run that fails or hangs becomes a JSON line with
"error" (a watchdog kills the processes of a phase past its deadline). Run it before any JAX process
takes the GPUs.

    PYTHONPATH=$PWD python3 scripts/bench_scaling_torch.py [--gpus 2,1] [--modes ddp,fsdp2] [--deadline-s 200]
CPU check of the mechanics (gloo, tiny model, no compile):
    python scripts/bench_scaling_torch.py --device cpu --tiny --compile none --ar-sizes 1MiB
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import queue as queue_mod
import socket
import sys
import time
import traceback

NVLS = "NCCL_NVLS_ENABLE"   # NVLink multicast stays off on the lent machines


def _bytes(s: str) -> int:
    low = s.strip().lower()
    for u, m in (("kib", 2**10), ("mib", 2**20), ("gib", 2**30), ("b", 1)):
        if low.endswith(u):
            return int(float(low[: -len(u)]) * m)
    return int(low)


def llama_config(tiny: bool, model: str = "llama3_1b"):
    """transformers' LlamaConfig of meshlab's preset `model` (the same shape the JAX side trains)."""
    from transformers import LlamaConfig
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    if tiny:   # the CPU check: same code paths, toy sizes
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, rope_theta=500000.0,
                          tie_word_embeddings=True, rope_scaling=rope)
    else:
        import models
        m = models.preset(model)
        cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.mlp_dim,
                          num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
                          head_dim=m.head_dim, max_position_embeddings=8192, rope_theta=m.rope_theta,
                          tie_word_embeddings=m.tie_embeddings, rope_scaling=rope)
    cfg._attn_implementation = "sdpa"
    return cfg


def flops_per_token(cfg, n_params: int, seq: int) -> float:
    """6 x parameters (the tied embedding counted once stands for the head GEMM) + causal attention."""
    return 6 * n_params + 6 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * cfg.head_dim


# ---------------------------------------------------------------------------------------------- worker side
def _sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(step, dev, warmup: int, steps: int):
    """Warm-up steps (compiles), then the median of `steps` synchronised steps: (warm-up s, median step
    s, the last loss). The peak memory counter is reset after the warm-up."""
    import torch
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(dev)
    warm_s = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return warm_s, sorted(times)[len(times) // 2], loss


def collectives(dev, world: int, sizes: list[int], iters: int) -> list[dict]:
    """Bus bandwidth as nccl-tests counts it (n = one rank's input bytes): all-reduce 2(p-1)/p n,
    all-gather (p-1) n, reduce-scatter (p-1)/p n. `loop` = `iters` back-to-back calls / iters (device
    time); `call` = median of single calls each waited for (what a blocking caller sees)."""
    import torch
    import torch.distributed as dist
    f = (world - 1) / world
    rows = []
    for op in ("all-reduce", "all-gather", "reduce-scatter"):
        for n in sizes:
            elems = max(n // 4 // world * world, world)
            x = torch.zeros(elems, dtype=torch.float32, device=dev)
            if op == "all-reduce":
                run, wire = (lambda: dist.all_reduce(x)), 2 * f * elems * 4  # noqa: F821 (x is deleted after the timing loop)
            elif op == "all-gather":
                out = torch.empty(elems * world, dtype=torch.float32, device=dev)
                run, wire = (lambda: dist.all_gather_into_tensor(out, x)), (world - 1) * elems * 4  # noqa: F821 (x is deleted after the timing loop)
            else:
                out = torch.empty(elems // world, dtype=torch.float32, device=dev)
                run, wire = (lambda: dist.reduce_scatter_tensor(out, x)), f * elems * 4  # noqa: F821 (x is deleted after the timing loop)
            for _ in range(3):
                run()
            _sync(dev)
            dist.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                run()
            _sync(dev)
            loop = (time.perf_counter() - t) / iters
            calls = []
            for _ in range(5):
                t = time.perf_counter()
                run()
                _sync(dev)
                calls.append(time.perf_counter() - t)
            call = sorted(calls)[len(calls) // 2]
            rows.append({"op": op, "bytes": elems * 4, "loop_us": loop * 1e6, "call_us": call * 1e6,
                         "busbw_GBps": wire / loop / 1e9, "busbw_call_GBps": wire / call / 1e9})
            del x
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def train(mode: str, dev, world: int, a) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    cfg = llama_config(a.tiny, a.model)
    torch.manual_seed(0)
    with dev:   # parameters created on the device (the CPU init of 1.2B parameters takes many seconds)
        model = LlamaForCausalLM(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    fp8_note = float8_linears(model) if a.float8 else ""
    layers = model.model.layers
    if a.compile == "blocks":   # one compiled decoder layer, reused by every layer (torchtitan's recipe)
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i])
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, gradient_as_bucket_view=True)
        mp_note = "fp32 params, autocast bf16"
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(dev.type, (world,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.fsdp_mp == "policy"
              else MixedPrecisionPolicy())
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)    # the rest: tied embedding/head, final norm
        mp_note = ("bf16 params/fp32 reduce (MixedPrecisionPolicy) + autocast" if a.fsdp_mp == "policy"
                   else "fp32 params, autocast bf16")
    if a.compile == "model":
        model = torch.compile(model)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        opt_note = "fused"
    except (RuntimeError, TypeError, ValueError) as e:   # stated in the row, never silent
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        opt_note = f"foreach (fused refused: {str(e)[:80]})"

    def ce(logits, labels):
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss_fn = torch.compile(ce) if a.compile != "none" else ce

    g = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g).to(dev)
    inp, lab = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=inp, use_cache=False).logits
            loss = loss_fn(logits, lab)
        loss.backward()
        if a.clip_grad > 0:   # torchtitan clips every step (max_norm 1.0), as meshlab's AdamW chain does
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    warm_s, dt, loss = time_steps(step, dev, a.warmup, a.steps)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    # the slowest rank's step and the largest peak: what the group delivers
    red = torch.tensor([dt, float(peak)], dtype=torch.float64, device=dev)
    dist.all_reduce(red, op=dist.ReduceOp.MAX)
    dt, peak = float(red[0]), float(red[1])
    tok_gpu = a.batch * a.seq / dt
    return {"tokens_per_s_per_gpu": tok_gpu, "step_ms": dt * 1e3, "peak_mem_gib": peak / 2**30,
            "mfu_989": tok_gpu * flops_per_token(cfg, n_params, a.seq) / 989e12, "loss": float(loss.detach()),
            "warmup_s": warm_s, "batch_per_gpu": a.batch, "seq": a.seq, "params": n_params,
            "compile": a.compile, "precision": mp_note + fp8_note, "optimizer": opt_note, "clip_grad": a.clip_grad,
            "model": "tiny" if a.tiny else a.model}


def float8_linears(model) -> str:
    """torchao's float8 training on the decoder layers' projections (q, k, v, o, gate, up, down), the
    LM head left in bf16: meshlab's model.matmul_dtype=float8 split. torchao's default recipe scales
    per tensor from the current amax (tensorwise, dynamic), as meshlab's does; converted before
    torch.compile and FSDP, as torchtitan orders it. Returns the row's note."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise SystemExit(f"--float8 needs torchao ({e}); carry its wheel to the GPU machine") from None
    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda module, fqn: fqn.startswith("model.layers."))
    import torchao
    return f"; torchao {torchao.__version__} float8 projections (tensorwise)"


def worker(rank: int, world: int, gpu: int, port: int, jobs: list[str], a, q, group: str):
    """One process of one group; rank 0 puts each job's result (or any rank its error) on the queue."""
    job = "init"
    try:
        import torch
        import torch.distributed as dist
        os.environ["LOCAL_RANK"] = str(gpu)
        if a.device == "cuda":
            torch.cuda.set_device(gpu)
            dev = torch.device("cuda", gpu)
        else:
            dev = torch.device("cpu")
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=a.nccl_timeout_s),
                                device_id=dev if a.device == "cuda" else None)
        if hasattr(torch, "_dynamo"):
            for k in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, k):
                    setattr(torch._dynamo.config, k, 64)
        for job in jobs:
            if job == "collectives":
                out = {"collectives": collectives(dev, world, [_bytes(s) for s in a.ar_sizes.split(",")], a.ar_iters)}
            else:
                out = train(job, dev, world, a)
            if rank == 0:
                name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
                q.put({"group": group, "job": job, "gpus": world, "device": name, **out})
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported, then the process ends
        q.put({"group": group, "job": job, "gpus": world, "rank": rank,
               "error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-800:]})
        q.close()
        q.join_thread()   # the put goes through a feeder thread: let it reach the pipe before the hard exit
        os._exit(1)


# ---------------------------------------------------------------------------------------------- parent side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_phases(gpus: list[int], modes: list[str], ngpu: int, concurrent: bool, collectives: bool):
    """[[(group name, world, [gpu ids], [jobs])]]: one phase per GPU count; the phases run one after another.
    On 1 GPU, with `concurrent`, the modes run at once, each on its own GPU (separate devices, no links used)."""
    phases = []
    for n in gpus:
        if n > ngpu:
            phases.append([(f"x{n}", n, [], [])])   # reported as not run
            continue
        if n == 1 and concurrent and ngpu >= 2:
            phases.append([(f"x1-{m}", 1, [i], [m]) for i, m in enumerate(modes[:ngpu])]
                          + ([("x1-rest", 1, [0], modes[ngpu:])] if len(modes) > ngpu else []))
        else:
            jobs = (["collectives"] if collectives and n > 1 else []) + modes
            phases.append([(f"x{n}", n, list(range(n)), jobs)])
    return phases


def run_phase(phase, a, deadline: float, emit) -> None:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs, expected = [], set()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    for group, world, gpu_ids, jobs in phase:
        if not gpu_ids:
            emit({"group": group, "gpus": world, "error": f"not run: {world} GPUs asked, fewer present"})
            continue
        port = _free_port()
        expected |= {(group, j) for j in jobs}
        for rank in range(world):
            gpu = gpu_ids[rank]
            if world == 1 and a.device == "cuda":   # a lone process sees only its GPU (DeviceMesh cannot pick another)
                os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu) if saved is None else saved.split(",")[gpu]
                gpu = 0
            p = ctx.Process(target=worker, args=(rank, world, gpu, port, jobs, a, q, group), daemon=True)
            p.start()
            procs.append(p)
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    done, failed = set(), {}

    def take(msg):
        key = (msg["group"], msg["job"])
        if "error" in msg:
            if msg["group"] in failed:      # the first error of a group is the one that says why
                return
            failed[msg["group"]] = msg["job"]
        elif key in done:
            return
        done.add(key)
        if len(phase) > 1:   # 1-GPU runs side by side on separate GPUs: said in the row
            msg["ran_beside"] = [g for g, *_ in phase if g != msg["group"]]
        emit(msg)

    pending = lambda: {k for k in expected if k not in done and k[0] not in failed}  # noqa: E731
    while pending() and time.time() < deadline:
        try:
            take(q.get(timeout=1.0))
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs):
                break
    while True:   # messages from several processes need not arrive in order: drain what was sent
        try:
            take(q.get(timeout=0.5))
        except queue_mod.Empty:
            break
    for p in procs:
        p.join(timeout=5 if not pending() and not failed else 0.1)
        if p.is_alive():
            p.kill()
    for group, job in sorted(k for k in expected if k not in done):
        if group in failed:
            why = f"not run: {failed[group]} failed first in this group"
        else:
            why = "timeout: past this phase's deadline" if time.time() >= deadline else "process ended without a result"
        emit({"group": group, "job": job, "error": why})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="2,1", help="GPU counts, run in this order (one phase each)")
    ap.add_argument("--modes", default="ddp,fsdp2")
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", choices=("blocks", "model", "none"), default="blocks",
                    help="blocks: each decoder layer compiled (one graph reused); model: the whole wrapped model")
    ap.add_argument("--fsdp-mp", choices=("policy", "autocast"), default="policy",
                    help="FSDP2 precision: bf16 gathered params + fp32 reduce, or fp32 params under autocast only")
    ap.add_argument("--clip-grad", type=float, default=0.0,
                    help="clip_grad_norm_ to this global norm every step (foreach), as torchtitan does (1.0); 0: off")
    ap.add_argument("--float8", action="store_true",
                    help="torchao float8 training of the decoder layers' projections (the FP8 peer)")
    ap.add_argument("--no-concurrent", action="store_true", help="1-GPU runs one after another on GPU 0")
    ap.add_argument("--no-collectives", action="store_true")
    ap.add_argument("--ar-sizes", default="64MiB,256MiB,1GiB,4GiB")
    ap.add_argument("--ar-iters", type=int, default=20)
    ap.add_argument("--deadline-s", type=float, default=200, help="the whole script, all phases")
    ap.add_argument("--phase-reserve-s", type=float, default=45, help="kept for each later phase")
    ap.add_argument("--nccl-timeout-s", type=float, default=120)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default="llama3_1b", help="meshlab preset whose shape the torch model takes")
    ap.add_argument("--out", default="", help="also append the JSON lines to this file")
    a = ap.parse_args(argv)
    start = time.time()
    if os.environ.get(NVLS) != "0":
        os.environ[NVLS] = "0"
    sink = open(a.out, "a") if a.out else None

    def emit(row):
        row = {"bench": "torch_peer", **row}
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    try:
        import torch
        import transformers
        ngpu = torch.cuda.device_count() if a.device == "cuda" else 2   # NVML count: no CUDA context here
        info = {"event": "start", "torch": torch.__version__, "transformers": transformers.__version__,
                "gpus_present": ngpu, NVLS: os.environ[NVLS], "date": datetime.datetime.now().isoformat(timespec="seconds")}
        if a.device == "cuda":
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))   # no CUDA context in this process
        emit(info)
        modes = [m for m in a.modes.split(",") if m]
        bad = [m for m in modes if m not in ("ddp", "fsdp2")]
        if bad:
            emit({"error": f"unknown mode(s) {bad}: use ddp, fsdp2"})
            return 2
        phases = plan_phases([int(g) for g in a.gpus.split(",")], modes, ngpu, not a.no_concurrent, not a.no_collectives)
        for i, phase in enumerate(phases):   # a hung phase leaves the later ones their reserve
            run_phase(phase, a, start + a.deadline_s - a.phase_reserve_s * (len(phases) - 1 - i), emit)
    except Exception as e:  # noqa: BLE001 - the line the driver greps for
        emit({"error": f"{type(e).__name__}: {str(e)[:300]}"})
        return 1
    finally:
        if sink:
            sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
