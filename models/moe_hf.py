"""Hugging Face Mixtral <-> meshlab MoE: config fields both ways and the parameter key map.

Mixtral is Llama attention with a sparse MoE feed-forward: `block_sparse_moe.gate` [E, d] (the
router: softmax over experts, top-k, renormalised: models/moe.py's `softmax` + `norm_topk`) and per
expert `w1` (gate) [f, d], `w3` (up) [f, d], `w2` (down) [d, f]. transformers 5.x keeps the experts
fused in memory but writes these per-expert names to safetensors, so a checkpoint from either major
version reads the same. meshlab stacks the experts: w_gate/w_up [E, d, f], w_down [E, f, d].
"""
from __future__ import annotations

import dataclasses

import numpy as np

from models import llama_hf
from models.moe import MoeConfig


def config_from_hf(hf: dict, **overrides) -> MoeConfig:
    if hf.get("model_type") != "mixtral":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r}: the MoE import reads Mixtral checkpoints")
    if hf.get("sliding_window"):
        raise ValueError(f"config.json sliding_window={hf['sliding_window']}: sliding-window attention is not "
                         "supported; only full causal attention loads")
    dense = llama_hf.config_from_hf(dict(hf, model_type="llama"))
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}
    fields.update(mlp_dim=0, n_experts=llama_hf.hf_int(hf, "num_local_experts"),
                  top_k=llama_hf.hf_int(hf, "num_experts_per_tok"), expert_mlp_dim=llama_hf.hf_int(hf, "intermediate_size"),
                  router_score="softmax", norm_topk=True,
                  aux_loss_weight=llama_hf.hf_float(hf, "router_aux_loss_coef", 0.01))
    fields.update(overrides)
    cfg = MoeConfig(**fields)
    cfg.validate()
    return cfg


def config_to_hf(cfg: MoeConfig, **kw) -> dict:
    """Mixtral's config.json for cfg (kw: llama_hf.config_to_hf's). A run Mixtral cannot express (a
    shared expert, sigmoid router scores, unnormalised top-k weights) is refused, naming the fields."""
    other = [why for bad, why in ((cfg.shared_mlp_dim, f"a shared expert (model.shared_mlp_dim={cfg.shared_mlp_dim})"),
                                  (cfg.router_score != "softmax", f"model.router_score={cfg.router_score}"),
                                  (not cfg.norm_topk, "model.norm_topk=false")) if bad]
    if other:
        raise ValueError(f"{cfg.name} has {', '.join(other)}, which Mixtral's format does not hold; only a run "
                         "with softmax scores renormalised over the top-k and no shared expert exports")
    hf = llama_hf.config_to_hf(cfg, **kw)
    hf.pop("mlp_bias")
    hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=cfg.expert_mlp_dim,
              num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
              router_aux_loss_coef=cfg.aux_loss_weight, sliding_window=None)
    return hf


@dataclasses.dataclass(frozen=True)
class ExpertKeyMap(llama_hf.KeyMap):
    """A stacked expert bank: `hf` names one expert's tensor ({i} layer, {e} expert); `read` stacks them,
    `write` splits one layer's [E, ...] bank into them."""
    n_experts: int = 1

    def read(self, get, i) -> np.ndarray:
        return np.stack([np.asarray(get(self.hf.format(i=i, e=e)), np.float32) for e in range(self.n_experts)])

    def write(self, layer, cfg, i) -> dict:
        bank = self.to_hf(layer, cfg)                                   # [E, out, in]
        return {self.hf.format(i=i, e=e): bank[e] for e in range(self.n_experts)}


def key_map(cfg: MoeConfig) -> list:
    pre = "model.layers.{i}.block_sparse_moe."
    dense = [km for km in llama_hf.key_map(cfg) if km.path[:2] != ("layers", "mlp")]
    swap = lambda w, c: np.swapaxes(w, -1, -2)  # noqa: E731
    t_last = (swap, swap)                        # HF [E, out, in] <-> meshlab [E, in, out]
    experts = [ExpertKeyMap(("layers", "moe", name), pre + "experts.{e}." + hf + ".weight", *t_last,
                            n_experts=cfg.n_experts)
               for name, hf in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))]
    router = llama_hf.KeyMap(("layers", "moe", "router"), pre + "gate.weight", lambda w, c: w.T, lambda w, c: w.T)
    return dense + experts + [router]
