"""The training peer of scripts/bench_moe.py: transformers' Mixtral at a meshlab MoE preset's shape
(random weights; attention, rope and vocabulary from bench_scaling_torch.llama_config, the experts
from the preset), torch.compile per decoder layer where it works (else eager, said in the row), AMP
bf16, fused AdamW, the router's load-balancing loss on (as ours; Mixtral has no z-loss). Tokens/s and
MFU of active FLOPs by meshlab's own formula: the Mixtral config read back through models/moe_hf.py,
then MoeConfig.train_flops_per_token. One JSON line on stdout. Run it in its own process, before JAX
takes the GPU.

    PYTHONPATH=$PWD python3 scripts/bench_moe_torch.py [--model moe_1b_8e] [--batch 4] [--seq 4096]
CPU smoke of the same code (tiny shape, no compile):
    python scripts/bench_moe_torch.py --device cpu --tiny --compile none --batch 2 --seq 32 --steps 2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]


def mixtral_config(tiny: bool, model: str):
    """transformers' MixtralConfig at `model`'s shape (tiny: bench_scaling_torch's toy attention, 4
    experts of its MLP width, top-2)."""
    import bench_scaling_torch
    import models
    from transformers import MixtralConfig
    base = bench_scaling_torch.llama_config(tiny, model).to_dict()
    m = models.preset(model)
    if not hasattr(m, "n_experts") or m.shared_mlp_dim:
        raise SystemExit(f"--model {model}: the Mixtral peer needs an MoE preset without a shared expert "
                         "(moe_1b_8e, moe_1b_16e)")
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps",
            "rope_parameters", "rope_theta", "rope_scaling")          # the rope keys this version has
    experts = (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=base["intermediate_size"])
               if tiny else dict(num_local_experts=m.n_experts, num_experts_per_tok=m.top_k,
                                 intermediate_size=m.expert_mlp_dim))
    cfg = MixtralConfig(**{k: base[k] for k in keys if base.get(k) is not None}, **experts,
                        output_router_logits=True, router_aux_loss_coef=m.aux_loss_weight, sliding_window=None)
    cfg._attn_implementation = "sdpa"
    return cfg


def ours(cfg):
    """meshlab's MoeConfig of the same shape (its FLOP formula is the one our MFU uses)."""
    from models import moe_hf
    d = cfg.to_dict()
    d.update(model_type="mixtral", sliding_window=None)
    return moe_hf.config_from_hf(d)


def run(a) -> dict:
    import bench_scaling_torch
    import torch
    from transformers import MixtralForCausalLM
    dev = torch.device(a.device)
    cfg = mixtral_config(a.tiny, a.model)
    torch.manual_seed(0)
    with dev:
        model = MixtralForCausalLM(cfg)
    model.train()
    impl = getattr(model.config, "_experts_implementation", None) or "eager"
    try:
        opt, opt_note = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError) as e:   # stated in the row, never silent
        opt, opt_note = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), f"foreach ({str(e)[:80]})"
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g).to(dev)
    inp, lab = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    fwd = model

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = fwd(input_ids=inp, labels=lab, use_cache=False)   # CE in fp32 + aux_coef x balance loss
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    compiled = "eager"
    if a.compile != "none":
        layers = model.model.layers
        try:                                   # "where it works": a failure falls back to eager, said aloud
            if a.compile == "blocks":          # one compiled decoder layer reused by all (torchtitan's recipe)
                for i in range(len(layers)):
                    layers[i] = torch.compile(layers[i])
            else:
                fwd = torch.compile(model)
            step()
            compiled = f"torch.compile ({a.compile})"
        except Exception as e:  # noqa: BLE001
            for i in range(len(layers)):
                layers[i] = getattr(layers[i], "_orig_mod", layers[i])
            fwd, compiled = model, f"eager (torch.compile failed: {type(e).__name__}: {str(e)[:120]})"
    warm_s, dt, loss = bench_scaling_torch.time_steps(step, dev, a.warmup, a.steps)
    from meshlab.plan.account import DATASHEET_BF16_FLOPS    # the peak our MFU divides by
    m = ours(cfg)
    tok_s = a.batch * a.seq / dt
    return {"peer": f"transformers {__import__('transformers').__version__} Mixtral, experts {impl}, {compiled}, "
                    f"AMP bf16, AdamW {opt_note}, router aux loss on",
            "model": "tiny" if a.tiny else a.model, "batch": a.batch, "seq": a.seq, "tokens_per_s": tok_s,
            "step_ms": dt * 1e3, "mfu": tok_s * m.train_flops_per_token(a.seq) / DATASHEET_BF16_FLOPS["h200"],
            "active_params": m.matmul_param_count(), "loss": float(loss.detach()), "warmup_s": warm_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moe_1b_8e")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", default="blocks", choices=("blocks", "model", "none"),
                   help="blocks: each decoder layer compiled (one graph, fast to build); model: the whole model")
    p.add_argument("--tiny", action="store_true", help="toy shape (CPU smoke of the mechanics)")
    a = p.parse_args(argv)
    try:
        row = run(a)
    except Exception as e:  # noqa: BLE001  the caller records the failure as a row
        row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps(row), flush=True)
    return 1 if "error" in row else 0


if __name__ == "__main__":
    sys.exit(main())
