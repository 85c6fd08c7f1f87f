"""The training peer: transformers' Llama at the llama3_1b shape, torch.compile, AMP bf16,
fused AdamW. Prints one JSON line. Run in its own process (it must not share the GPU with JAX)."""
import argparse
import json
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    try:   # after the arguments: --help needs neither
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        sys.exit(f"bench_train_torch.py: the torch peer needs torch and transformers ({e}); install them, or run "
                 "bench_train.py --no-peer")
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    cmodel = torch.compile(model)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device="cuda")
    inp, lab = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = cmodel(input_ids=inp).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), lab.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    dt = times[len(times) // 2]
    n = sum(p.numel() for p in model.parameters())   # tied: the head is the embedding
    flops_tok = 6 * (n - cfg.vocab_size * 2048 + cfg.vocab_size * 2048) + 6 * 16 * a.seq * 2048
    tok_s = a.batch * a.seq / dt
    print(json.dumps({"batch": a.batch, "tokens_per_s": tok_s, "step_ms": dt * 1e3, "mfu_989": tok_s * flops_tok / 989e12,
                      "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss)}))


if __name__ == "__main__":
    main()
