"""The planner against the compiler: the real train step, compiled on abstract inputs, 8 CPU devices.

Per rule file (the memory and communication accounts, proved against the compiler):
- params / grads / Adam bytes per device: the compiled program's input shardings (grads: the
  compiled loss-and-grads region's output shardings; zero1's are the reduce-scattered Adam shards,
  its full accumulator lives inside the region) equal the planner's, exactly, and follow the ZeRO
  arithmetic of the rule file;
- the planner's activation + temporary estimate is within 20% of `memory_analysis().temp`;
- collectives counted in the HLO (loop bodies x n_layers) match the planner per kind within 10%.

CPU vs GPU: XLA on CPU lowers a GSPMD-propagated reduce-scatter to all-reduce + slice, so the
comparison uses `comm.cpu_view` (propagated reduce-scatters counted as all-reduces of the full
buffer); the explicit shard_map reduce-scatters (zero2, fsdp) are reduce-scatters on both.
fsdp_tp: the FSDP gather runs in a nested shard_map that keeps `tensor` manual
(meshlab.rules.materialize), so each device gathers only its tensor slice and the HLO matches the
plan exactly (before that fix XLA replicated the weights over tensor too: 5x the gather bytes).
fsdp_tp_sp: 6 sequence all-gathers per layer, as in Megatron's sequence parallelism: before attention
and the MLP, the backward's transposes of the two reduce-scatters, and a re-gather of the split block
input for the weight-gradient GEMMs (autodiff saves the split input, not the gathered one); plus the
head's input gather and the embedding's output-grad gather. The planner counts each (comm.py).
Temp: the peak is either the loss head or one layer's backward, never both (memory.plan_memory); under
ring attention it can be the last layer's forward (memory_context).
"""
from __future__ import annotations

import math

import pytest

from helpers import EP_MESH, MESH_FOR, small_config
from meshlab.plan import comm, memory
from meshlab.train import compiled
from meshlab.train.loop import build_trainer

# One xdist worker runs test_zero, test_memory_comm and test_plan: compiled.measure caches each rule file's compiled step per
# process, and the files measure the same steps (make test: --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("compiled_steps"), pytest.mark.cheap_codegen]

RULES = ("dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp", "fsdp_tp_sp")
GRADS_READ = ("zero1", "zero2", "fsdp_tp")   # one compile more each: replicated, zero-2, zero-3 + tensor
MID = ["model.n_layers=4", "model.d_model=512", "model.n_heads=8", "model.n_kv_heads=4", "model.head_dim=64",
       "model.mlp_dim=1536", "model.vocab_size=8192", "model.dtype=float32", "data.seq_len=256",
       "data.global_batch=16"]


def _cfg(rules, extra=()):
    return small_config(rules, MESH_FOR.get(rules), extra=list(extra))


def _plan(cfg):
    tr = build_trainer(cfg)
    mem = memory.plan_memory(tr.md, tr.rules, tr.mesh, cfg.data.global_batch, cfg.data.seq_len,
                             cfg.data.microbatches, cfg.model.remat)
    comms = comm.step_collectives(tr.md, tr.rules, tr.mesh, cfg.data.global_batch, cfg.data.seq_len,
                                  cfg.data.microbatches, cfg.model.remat)
    return tr, mem, comms


def _fwd(c) -> bool:
    return "jvp(" in c.line and "transpose(" not in c.line


def test_state_bytes_follow_zero_arithmetic_exactly():
    rows = []
    for r in RULES:
        cfg = _cfg(r)
        m = compiled.measure(cfg, grads=r in GRADS_READ)
        tr, mem, _ = _plan(cfg)
        st = mem["state"]
        assert (m.params, m.optimizer) == (st["params"], st["optimizer"]), r
        if m.grads >= 0:   # zero1 returns its gradients reduce-scattered onto the Adam shards
            assert m.grads == (st["optimizer"] // 2 if r == "zero1" else st["grads"]), r
        full = 4 * sum(math.prod(a.shape) for a in __import__("jax").tree.leaves(tr.md.abstract))
        rows.append((r, m.mesh, m.params, m.grads, m.optimizer, full))
    print(f"\n{'rules':<11} {'mesh':<28} {'params':>8} {'grads':>8} {'adam':>8}   (unsharded fp32 params {rows[0][5]})")
    for r, mesh, p, g, o, full in rows:
        print(f"{r:<11} {str(mesh):<28} {p:>8} {g if g >= 0 else '(spec)':>8} {o:>8}")
    by = {r: (p, g, o, full) for r, _, p, g, o, full in rows}
    full = by["dp"][3]
    assert by["dp"][0] == full and by["dp"][2] == 2 * full                  # ZeRO-0: all replicated
    assert by["zero1"][0] == full and by["zero1"][2] == 2 * full // 8      # ZeRO-1: Adam / 8
    assert by["zero1"][1] == full // 8                                     # reduced onto Adam's shards
    assert by["zero2"][1] == full // 8 and by["zero2"][2] == 2 * full // 8  # ZeRO-2: grads too
    assert by["fsdp"][0] == full // 8 and by["fsdp"][2] == 2 * full // 8    # ZeRO-3: everything / 8
    assert by["tp"][0] < full // 1.8 and by["tp"][0] > full // 2.2          # Megatron: most weights / tensor


@pytest.mark.parametrize("rules", RULES)
def test_temp_estimate_within_20_percent(rules):
    cfg = _cfg(rules)
    m = compiled.measure(cfg, grads=rules in GRADS_READ)
    _, mem, _ = _plan(cfg)
    est = mem["estimate_temp"]
    print(f"\n{rules}: compiler temp {m.temp} B, planner {est} B ({est / m.temp - 1:+.1%})")
    assert abs(est / m.temp - 1) <= 0.20


# (rule file, sequence, remat, lowest planner/compiler - 1): each rule file at a short and a longer
# sequence and under none and full remat, in 6 compiles of 2-5 s (the ep/32/none one is the smallest MoE step).
MOE_CASES = [("dp", 32, "full", -0.20), ("dp", 512, "none", -0.15), ("ep", 32, "none", -0.20),
             ("ep", 512, "full", -0.20), ("fsdp_ep", 32, "full", -0.20), ("fsdp_ep", 512, "none", -0.14)]


@pytest.mark.parametrize("rules,seq,remat,low", MOE_CASES)
def test_moe_temp_estimate(rules, seq, remat, low):
    """moe_tiny (no shared expert, 2 rows per device) against the compiler's temp, within 20% over and under.

    The experts' buffers are flattened to [b * S * k, ..] rows (a multiple of the probe length, so
    they grow with S) and, dropless over an expert axis of size ep, hold ep times the device's own
    assignments on each side of the exchange (without either the planner was 63% under on ep). The
    largest buffers of a layer's backward are the xla grouped GEMM's masked per-expert copies of its
    ragged operand, [G, R, width] for G experts per device (memory_moe.grouped_gemm_backward_bytes):
    without them the planner was 41% under on dp at S=32, 55% at S=512 under full remat, 41% on fsdp_ep.
    The expert axis splits the experts' weights for good: counting their gathered copies and layer
    gradients whole over it put fsdp_ep at S=32 under full remat 27% over.

    At S=512 under remat=none (measured -13% on dp and on fsdp_ep) the step's peak is the experts'
    backward, beside which the XLA attention's copy of the layer's saved probabilities out of the
    layer stack and its hoisted causal mask are live (memory.attention_backward_bytes; without them
    -25% and -21%). XLA:CPU also copies the saved fp32 exp(s - max) out of the stack there, one
    [b, h, S, S] fp32 array (8 MiB of the 10 MiB left on dp); XLA:GPU reads it in place, so the
    planner does not count it."""
    cfg = small_config(rules, EP_MESH.get(rules), extra=["model.name=moe_tiny", "model.shared_mlp_dim=0",
                                                         f"data.seq_len={seq}", f"model.remat={remat}"])
    m = compiled.measure(cfg, grads=False)
    _, mem, _ = _plan(cfg)
    est = mem["estimate_temp"]
    print(f"\n{rules} moe S={seq} {remat}: compiler temp {m.temp} B, planner {est} B ({est / m.temp - 1:+.1%})")
    assert low <= est / m.temp - 1 <= 0.20


# (rule file, remat, lowest and highest planner/compiler - 1): the dense tiny model at S=512, where the
# XLA attention's [b, h, S, S] arrays are most of the step's temp; two compiles of about 2 s.
LONG_CASES = [("dp", "none", -0.05, 0.10), ("fsdp", "full", -0.10, 0.10)]


@pytest.mark.parametrize("rules,remat,low,high", LONG_CASES)
def test_temp_estimate_at_long_sequence(rules, remat, low, high):
    """At S=512 the layer's backward peak is attention's: the saved (none) or recomputed (full) exp and
    probabilities, the dP and dS it forms and, under none, the probabilities copied out of the layer
    stack and the causal mask hoisted out of it (memory.attention_backward_bytes). Without them the
    planner is 23% under on dp/none and 46% under on fsdp/full (there it would take the MLP's
    recomputed residuals for the peak instead of attention's). Measured -1% (none) and -7% (full);
    none -1% on fsdp, -2% on tp and -1% on fsdp_tp_sp; full -8% on tp; save_dots -5% on fsdp_tp,
    save_dots_no_batch -7% on dp."""
    cfg = _cfg(rules, [f"model.remat={remat}", "data.seq_len=512"])
    m = compiled.measure(cfg, grads=False)
    _, mem, _ = _plan(cfg)
    est = mem["estimate_temp"]
    print(f"\n{rules} S=512 {remat}: compiler temp {m.temp} B, planner {est} B ({est / m.temp - 1:+.1%}), "
          f"peak {mem['peak phase']}")
    assert mem["peak phase"] == "layer backward"
    assert low <= est / m.temp - 1 <= high


def test_xla_attention_backward_arrays_per_device():
    """Tracing only (bf16 tiny, S=1024), in units of the device's scores (rows x heads x S x S): the XLA
    attention's backward adds dP (bf16) and dS (fp32), and under remat none the probabilities copied
    out of the layer stack (bf16) and the hoisted causal mask (bool, in the loss head phase too). A
    flash attention (cudnn) has none of them, and under remat none nothing else in the backward
    differs. Under full remat the recomputed exp (fp32) and probabilities (bf16) sit beside dP and dS;
    a tensor split halves the heads; ring attention's own backward (block_k tiles) copies nothing out of
    the layer stack and masks each tile where it forms it."""
    import dataclasses
    from meshlab.plan.search import PlanMesh
    from meshlab.rules import load_rules
    from models import model_def, preset
    cfg = dataclasses.replace(preset("tiny"), dtype="bfloat16")
    md, seq = model_def(cfg), 1024

    def act(rules, mesh, policy="none", attention="xla"):
        return memory.plan_memory(md, load_rules(rules), PlanMesh(mesh), 16, seq, 1, policy, attention)["activations"]
    n = 2 * cfg.n_heads * seq * seq             # 16 rows over data=8
    xla, flash = act("dp", {"data": 8}), act("dp", {"data": 8}, attention="cudnn")
    assert xla["attention backward"] == {"gradients": n * (2 + 4), "stack copy": n * 2, "mask": n}
    assert set(flash["attention backward"].values()) == {0}
    assert xla["backward working set"] - flash["backward working set"] == n * (2 + 4 + 2 + 1)
    assert xla["loss head"] - flash["loss head"] == n
    tp = act("tp", {"data": 4, "tensor": 2})    # 4 rows, half the heads
    assert tp["attention backward"]["gradients"] == 4 * (cfg.n_heads // 2) * seq * seq * (2 + 4)
    full = act("dp", {"data": 8}, "full")
    assert full["attention backward"] == {"gradients": n * (2 + 4), "stack copy": 0, "mask": 0}
    assert full["backward working set"] == pytest.approx(n * (4 + 2) + n * (2 + 4), rel=1e-9)
    ring = act("cp_ring", {"data": 2, "context": 4})["attention backward"]   # test_ring_attention_tiles_per_device
    assert ring["stack copy"] == ring["mask"] == 0


def test_ring_attention_tiles_per_device(monkeypatch):
    """Tracing only (bf16 tiny, S=8192 over context=4: 2048 tokens a shard, 2 rows): ring attention's jnp
    blocks hold (S/context) x block_k scores per head and ring step, never (S/context)^2: the backward's dP
    and dS per score of that tile plus its fp32 dQ/dK/dV accumulators, the dK/dV in flight and the 3 k/v
    blocks received. Only the 512 x 512 causal piece of the diagonal (split once, the rest tiled) is a
    single tile whose mask and fills JAX hoists out of the layer scan. A Pallas block kernel (what `auto`
    runs on a GPU for these head dims) keeps the tiles on chip."""
    import dataclasses
    from meshlab.plan import memory_context
    from meshlab.plan.search import PlanMesh
    from meshlab.rules import load_rules
    from models import model_def, preset
    cfg = dataclasses.replace(preset("tiny"), dtype="bfloat16")
    md, seq, sl = model_def(cfg), 8192, 2048
    mem = memory.plan_memory(md, load_rules("cp_ring"), PlanMesh({"data": 2, "context": 4}), 4, seq, 1, "full")
    lc = mem["local"]
    assert (lc.b, lc.s_attn, lc.ring_blocks.hops) == (2, sl, 3)
    assert (lc.ring_blocks.step, lc.ring_blocks.hoisted) == (sl * 512, 512 * 512)
    kv = 3 * 2 * lc.b * sl * lc.kvh * lc.hd * 2
    blocks = lc.b * sl * (lc.hd * 4 * (lc.h + 4 * lc.kvh) + 4 * lc.h) + kv
    assert mem["activations"]["attention backward"] == {"gradients": lc.b * lc.h * sl * 512 * (2 + 4) + blocks,
                                                         "stack copy": 0, "mask": 0}
    monkeypatch.setattr("meshlab.parallel.attention_blocks.resolve_block_impl", lambda impl, head_dim: "pallas")
    assert memory_context.ring_blocks(sl, 4, cfg.head_dim) == memory_context.RingBlocks(3, 0, 0, sl, 0)


def test_ulysses_runs_auto_attention_locally():
    """Tracing only: Ulysses' local attention is `dot_product_attention(impl="auto")` whatever model.attention
    says (meshlab/parallel/context.py), on a CPU the XLA attention: its [S, S] arrays on heads/context heads
    are counted even when the config names a flash kernel, unlike plain data parallelism."""
    from meshlab.plan.search import PlanMesh
    from meshlab.rules import load_rules
    from models import model_def, preset
    md, seq = model_def(preset("tiny")), 1024

    def backward(rules, mesh, attention):
        return memory.plan_memory(md, load_rules(rules), PlanMesh(mesh), 16, seq, 1, "full",
                                  attention)["activations"]["attention backward"]
    ulysses = {"data": 4, "context": 2}
    assert backward("cp_ulysses", ulysses, "cudnn") == backward("cp_ulysses", ulysses, "xla")
    assert backward("cp_ulysses", ulysses, "xla")["gradients"] == 4 * (4 // 2) * seq * seq * (2 + 4)   # bf16 dP
    assert backward("dp", {"data": 8}, "cudnn")["gradients"] == 0


def test_moe_dispatch_activations_grow_with_sequence_and_expert_axis():
    """Tracing only: one layer's saved residuals at S=4096 (and 2048), in units of one [b*S*k, d] fp32
    dispatch array. They grow linearly with S (flash attention: none is [S, S]). Over an expert axis
    of 8 each dispatch array holds the group's 8 x the device's assignments, so the difference is 7 x
    the dispatch arrays at expert=1: the dispatched rows, gate, up and h, four [b*S*k, d] bf16 arrays
    (moe_tiny: f = d), 2 units at least. Counted at the probe's length, as they once were, they added
    about 0.03 units at S=4096, with or without the expert axis."""
    from meshlab.plan.search import PlanMesh
    from meshlab.rules import load_rules
    from models import model_def, preset
    cfg = preset("moe_tiny")
    md, rules = model_def(cfg), load_rules("ep")
    unit = 2 * 4096 * cfg.top_k * cfg.d_model * 4       # 2 rows per device

    def saved(expert, seq=4096):
        mesh = PlanMesh({"data": 8 // expert, "expert": expert})
        return memory.plan_memory(md, rules, mesh, 16, seq, 1, "none", "cudnn")["activations"]["saved per layer"] / unit
    one, eight = saved(1), saved(8)
    assert one == pytest.approx(2 * saved(1, 2048), rel=0.02)   # a few per-row arrays of the router do not grow
    assert eight - one >= 7 * 4 * 0.5


# (rule file, mesh, sequence, remat, global batch, lowest and highest planner/compiler - 1): the dense tiny
# model, four compiles of 2-8 s; what each case holds to the compiler is in the test's docstring.
CP_CASES = [("cp_ring", "context=8", 512, "full", 16, -0.10, 0.05),
            ("cp_ring", "context=8", 512, "save_dots_attn", 16, -0.10, 0.05),
            ("cp_ring", "data=2,context=4", 4096, "none", 2, -0.10, 0.05),
            ("fsdp_cp", None, 512, "save_dots", 16, 0.0, 0.12),
            ("cp_ulysses", "data=4,context=2", 512, "full", 16, -0.12, 0.0)]


@pytest.mark.parametrize("rules,mesh,seq,remat,batch,low,high", CP_CASES)
def test_context_parallel_temp_estimate(rules, mesh, seq, remat, batch, low, high):
    """The context-parallel rule files against the compiler's temp (meshlab/plan/memory_context.py).

    Ring attention saves q, k, v, its output and an lse (its custom_vjp), not the XLA attention's
    [S/context, S/context] arrays the planner's trace shows, and forms [cq, bk] tiles a ring step at a
    time. Counted as the XLA attention's, the estimate would be 28% under on cp_ring context=8 (full)
    and 79% over at S=4096 (none). Each case's peak, and what dropping a term of it does:
      cp_ring, context=8, S=512, full (measured -5%): the last layer's forward, where JAX has hoisted
        the ring forward's loop invariants out of the layer scan (the diagonal step's masks and fp32
        fills, every step's accumulators: without them -32%), one step's scores and exponentials
        (-27%) and all 7 k/v blocks received, issued ahead of the blocks that read them (one: -16%);
      cp_ring, context=8, S=512, save_dots_attn (-4%): the same phase, with each layer's ring output kept;
      cp_ring, context=4, S=4096 (1024-token shards, tiled by block_k), none (-4%): the layer's
        backward, its tiles' recomputed scores and gradients (without them -20%);
      fsdp_cp, S=512, save_dots (+8%): the forward again, with every step's score tiles saved, both
        branches of a switched step (without them -55%; hoisted arrays -13%, forward tiles -9%);
      cp_ulysses, data=4, context=2, S=512, full (-8%): the layer's backward, the XLA attention that
        `auto` runs locally on the whole sequence for heads/context heads (as under dp).
    Across S = 512, 1024 and context 4, 8 under none and full, cp_ring and fsdp_cp measured -5% to
    +5%, cp_ulysses -9% to -1%; save_dots +5% to +8%, save_dots_no_batch -9% (cp_ring, S=1024)."""
    cfg = small_config(rules, mesh, extra=[f"data.seq_len={seq}", f"model.remat={remat}", f"data.global_batch={batch}"])
    m = compiled.measure(cfg, grads=False)
    _, mem, _ = _plan(cfg)
    est = mem["estimate_temp"]
    print(f"\n{rules} {mesh} S={seq} {remat}: compiler temp {m.temp} B, planner {est} B ({est / m.temp - 1:+.1%}), "
          f"peak {mem['peak phase']}")
    want = {"cp_ring": "layer forward" if seq <= 1024 else "layer backward", "fsdp_cp": "layer forward",
            "cp_ulysses": "layer backward"}[rules]
    assert mem["peak phase"] == want
    assert low <= est / m.temp - 1 <= high


@pytest.mark.parametrize("rules,mesh,extra", [("dp", None, ["model.remat=full"]),
                                               ("fsdp", "data=4,fsdp=2", ["model.remat=full"]),
                                               ("tp", "data=4,tensor=2", ["model.remat=full"]),
                                               ("fsdp_tp", None, ["model.remat=save_dots"])])
def test_temp_estimate_under_remat(rules, mesh, extra):
    """Under remat the compiled step's peak is either the loss head or one layer's backward (saved
    layer inputs + that layer's recompute + gradient buffers), never both at once; the planner takes
    the larger phase. It used to add them: +40% on fsdp/full, +45% on fsdp_tp/full; dp/full looked
    fine (+17%) only because the planner also left out XLA's copy of Adam's moments, which is live
    for the whole step (memory.plan_memory). Measured over all policies, 2/4 layers, 2/4 rows: 0-18%."""
    cfg = small_config(rules, mesh, extra=extra)
    m = compiled.measure(cfg, grads=False)
    _, mem, _ = _plan(cfg)
    est = mem["estimate_temp"]
    print(f"\n{rules} {mesh} {extra}: compiler temp {m.temp} B, planner {est} B ({est / m.temp - 1:+.1%})")
    assert abs(est / m.temp - 1) <= 0.20


@pytest.mark.parametrize("rules", RULES)
def test_collective_bytes_per_kind_within_10_percent(rules):
    cfg = _cfg(rules)
    m = compiled.measure(cfg, grads=rules in GRADS_READ)
    _, _, comms = _plan(cfg)
    want = comm.cpu_view(comms)
    got = m.per_step
    total = sum(got.values())
    print(f"\n{rules}: HLO {got}\n{' ' * len(rules)}  plan {want}")
    for kind in comm.KINDS:
        if want[kind] == 0:   # nothing else of significant size
            assert got[kind] <= 0.01 * total + 256, (kind, got[kind])
        else:
            assert abs(got[kind] / want[kind] - 1) <= 0.10, (kind, got[kind], want[kind])


def test_collective_bytes_under_full_remat():
    """fsdp_tp_sp, full remat: the backward re-gathers the fsdp weights and recomputes the attention
    output's reduce-scatter; its forward's sequence gathers serve the weight gradients."""
    cfg = _cfg("fsdp_tp_sp", ["model.remat=full"])
    m = compiled.measure(cfg, grads=False)
    _, _, comms = _plan(cfg)
    want = comm.cpu_view(comms)
    print(f"\nfsdp_tp_sp full: HLO {m.per_step}\n                 plan {want}")
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        assert abs(m.per_step[kind] / want[kind] - 1) <= 0.10, (kind, m.per_step[kind], want[kind])


def test_collective_placement():
    """dp all-reduces grads (the layers' inside the backward layer loop); zero2/fsdp reduce-scatter them;
    fsdp gathers inside the layer loop; tp all-reduces activations in the forward."""
    c = {r: compiled.measure(_cfg(r), grads=r in GRADS_READ).collectives for r in ("dp", "zero2", "fsdp", "tp")}
    _, mem, _ = _plan(_cfg("dp"))
    grads = mem["state"]["grads"]
    assert sum(x.bytes * (2 if x.in_loop else 1) for x in c["dp"] if x.kind == "all-reduce") >= grads   # 2 layers
    assert not [x for x in c["dp"] if x.kind in ("all-gather", "reduce-scatter")]
    for r in ("zero2", "fsdp"):
        assert sum(x.bytes * (2 if x.in_loop else 1) for x in c[r] if x.kind == "reduce-scatter") >= grads // 8
        assert sum(x.bytes for x in c[r] if x.kind == "all-reduce") < 1024, r   # only scalars (loss, norms)
    gathers = [x for x in c["fsdp"] if x.kind == "all-gather"]
    in_loop = sum(x.bytes for x in gathers if x.in_loop)
    assert in_loop > sum(x.bytes for x in gathers if not x.in_loop) / 2 and in_loop > 0
    assert [x for x in c["tp"] if x.kind == "all-reduce" and x.in_loop and _fwd(x)]


def test_mid_size_config_abstract():
    """A 4-layer d=512 model (17M params), compiled on abstract inputs only: state exact, temp within
    20%, collective bytes within 10%. fp32: in bf16 this program aborts XLA's CPU compiler (jax 0.10.2,
    `hlo_instruction.cc: Invalid binary instruction opcode copy`), so bf16 is checked on GPU only."""
    cfg = _cfg("fsdp", MID)
    m = compiled.measure(cfg, grads=False)
    _, mem, comms = _plan(cfg)
    assert (m.params, m.optimizer) == (mem["state"]["params"], mem["state"]["optimizer"])
    print(f"\nmid fsdp: temp {m.temp} vs {mem['estimate_temp']} ({mem['estimate_temp'] / m.temp - 1:+.1%}); "
          f"HLO {m.per_step} plan {comm.cpu_view(comms)}")
    assert abs(mem["estimate_temp"] / m.temp - 1) <= 0.20
    want = comm.cpu_view(comms)
    for kind in ("all-gather", "reduce-scatter"):
        assert abs(m.per_step[kind] / want[kind] - 1) <= 0.10, kind


def test_only_ragged_dot_expands_the_experts_operand():
    """The planner counts the masked per-expert copies only where `lax.ragged_dot` runs: `gemm: xla`, and
    `auto` off a GPU (here); the Mosaic and Triton kernels read each group's rows in place."""
    import dataclasses
    from meshlab.plan import memory_moe
    from models import preset
    cfg = preset("moe_tiny")
    assert [memory_moe.expands_ragged_operand(dataclasses.replace(cfg, gemm=g))
            for g in ("auto", "xla", "mosaic", "triton")] == [True, True, False, False]
