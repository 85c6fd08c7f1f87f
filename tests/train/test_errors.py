"""Every validation path of the core gives one clear message naming what is wrong and the fix."""
import textwrap
from pathlib import Path

import jax
import pytest

from meshlab.mesh import MeshError, make_mesh, parse_mesh_spec, resolve_sizes
from meshlab.rules import RulesError, load_rules, shipped_rules
from meshlab.train.config import ConfigError, load_config
from meshlab.train.loop import build_trainer
from tests.helpers import small_config

BASE = textwrap.dedent("""\
    mesh: {data: -1}
    batch: [data]
    rules:
      vocab: null
      embed: null
      heads: null
      kv_heads: null
      head_dim: null
      mlp: null
      experts: null
      layers: null
      act_batch: data
      act_seq: null
      act_attn_seq: null
      act_embed: null
      act_heads: null
      act_kv_heads: null
      act_mlp: null
      act_vocab: null
      act_experts: null
      cache_batch: data
      cache_seq: null
      cache_kv_heads: null
      cache_pages: null
    state: {params: replicated, grads: replicated, optimizer: replicated}
    """)


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_user_rule_file_anywhere_works_like_a_shipped_one(tmp_path):
    r = load_rules(write(tmp_path, BASE, "mine.yaml"))
    assert r.name == "mine" and r.rules["act_batch"] == ("data",)
    assert {"dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp", "fsdp_tp_sp"} <= set(shipped_rules())


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("  mlp: null", "  mlpp: null"), "unknown logical name 'mlpp'"),
    (lambda t: t.replace("  mlp: null", "  mlp: tensr"), "unknown mesh axis 'tensr'"),
    (lambda t: t.replace("  mlp: null", "  mlp: [tensor, tensor]"), "listed twice"),
    (lambda t: t.replace("mesh: {data: -1}", "mesh: {dta: -1}"), "unknown mesh axis 'dta'"),
    (lambda t: t + "extra: 1\n", "unknown top-level key 'extra'"),
    (lambda t: t.replace("params: replicated", "params: sharded"), "not a ZeRO stage"),
    (lambda t: t.replace("optimizer: replicated", "optimizer: shrded"), "must be `sharded` or `replicated`"),
    (lambda t: "rules: [\n", "not valid YAML"),
    (lambda t: t.replace("mesh: {data: -1}", "mesh: {data: 2.5}"), "`mesh:` mesh axis 'data' has size 2.5; sizes are whole numbers"),
    (lambda t: t.replace("mesh: {data: -1}", "mesh: {data: [2]}"), "`mesh:` mesh axis 'data' has size [2]; sizes are whole numbers"),
    (lambda t: t.replace("mesh: {data: -1}", "mesh: {data: true}"), "`mesh:` mesh axis 'data' has size True; sizes are whole numbers"),
    (lambda t: t.replace("mesh: {data: -1}", "mesh: {data: 0}"), "`mesh:` mesh axis 'data' has size 0; sizes are positive or -1"),
    (lambda t: t + "strategies: [1]\n", "`strategies:` must be a mapping"),
    (lambda t: t.replace("state: {params: replicated, grads: replicated, optimizer: replicated}", "state: sharded"),
     "`state:` must be a mapping"),
    (lambda t: t + "3: 1\n", "unknown top-level key 3"),
    (lambda t: t.replace("batch: [data]", "batch: [data, context]") + "strategies: {attention: ring}\n",
     "`batch` lists context, but `strategies.attention: ring` splits each sequence over context"),
    (lambda t: t.replace("act_heads: null", "act_heads: context") + "strategies: {attention: ulysses}\n",
     "`rules.act_heads` lists context, but `strategies.attention: ulysses` splits each sequence"),
])
def test_bad_rule_files(tmp_path, edit, message):
    with pytest.raises(RulesError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_rules(write(tmp_path, edit(BASE)))


def test_unknown_shipped_name_lists_near_matches():
    with pytest.raises(RulesError, match="did you mean 'fsdp_tp'"):
        load_rules("fsdp_pt")


def test_missing_rule_for_a_used_logical_name(tmp_path):
    path = write(tmp_path, BASE.replace("  mlp: null\n", ""))
    with pytest.raises(RulesError, match="no rule for logical name 'mlp'"):
        build_trainer(small_config(path))


def test_axis_used_twice_in_one_spec(tmp_path):
    path = write(tmp_path, BASE.replace("  heads: null", "  heads: tensor").replace("  embed: null", "  embed: tensor")
                 .replace("mesh: {data: -1}", "mesh: {data: 2, tensor: 4}"))
    with pytest.raises(RulesError, match="'tensor' is used twice in one spec"):
        build_trainer(small_config(path))


def test_dimension_not_divisible_names_file_rule_path_and_shape(tmp_path):
    path = write(tmp_path, BASE.replace("  kv_heads: null", "  kv_heads: tensor").replace(
        "mesh: {data: -1}", "mesh: {data: 2, tensor: 4}"))
    with pytest.raises(RulesError, match=r"rule `kv_heads: \['tensor'\]` splits dimension 2 of params\['layers'\]"
                                         r"\['attn'\]\['wk'\] \(shape \(2, 32, 2, 8\)\) into 4 shards.*--mesh with tensor "
                                         r"dividing 2, e.g. tensor=2 with another axis at -1"):
        build_trainer(small_config(path))


def test_mesh_errors():
    # tests run on the CPU: the hint names the simulated-device count this mesh would take
    with pytest.raises(MeshError, match="needs 2 devices but 8 are present.*; or, on a CPU, --cpu-devices 2 to"):
        make_mesh("tensor=2")
    with pytest.raises(MeshError, match=r"does not divide the 8 devices.*--cpu-devices 9 to simulate 9 devices"):
        make_mesh("data=-1,tensor=3")
    with pytest.raises(MeshError, match=r"needs 3 devices but 8 are present.*; or --devices 3$"):
        resolve_sizes("data=3", 8, count_flag="--devices")     # a sizes-only tool names its own flag
    with pytest.raises(MeshError, match="unknown mesh axis 'model'"):
        parse_mesh_spec("model=2")
    with pytest.raises(MeshError, match="more than one -1"):
        parse_mesh_spec("data=-1,fsdp=-1")
    with pytest.raises(MeshError, match="is not AXIS=SIZE"):
        parse_mesh_spec("data2")
    with pytest.raises(MeshError, match="names axis 'fsdp' twice; give each axis one size"):
        parse_mesh_spec("fsdp=4,tensor=2,fsdp=1")                # the later size would win
    with pytest.raises(MeshError, match="0 devices: a mesh needs at least 1 \\(--devices\\)"):
        resolve_sizes("fsdp=-1", 0, count_flag="--devices")       # -1 would fill to 0
    with pytest.raises(MeshError, match="mesh axis 'fsdp' has size 1.5; sizes are whole numbers"):
        parse_mesh_spec({"fsdp": 1.5})                           # a float was cut to 1
    assert dict(make_mesh("fsdp=-1,tensor=2").shape) == {"data": 1, "stage": 1, "fsdp": 4, "context": 1,
                                                         "expert": 1, "tensor": 2}


def test_batch_errors():
    with pytest.raises(RulesError, match="smaller than the data-parallel size 8"):
        build_trainer(small_config("dp", extra=["data.global_batch=4"]))
    with pytest.raises(RulesError, match="not divisible by data-parallel size 8 x 1"):
        build_trainer(small_config("dp", extra=["data.global_batch=12"]))
    with pytest.raises(RulesError, match="8 x 4 micro-batches"):
        build_trainer(small_config("dp", extra=["data.microbatches=4"]))


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'; did you mean optim.lr") as err:
        load_config("default", ["optim.lrr=1"])
    assert "optim," not in str(err.value) and not str(err.value).endswith("optim?")    # keys, not their sections
    with pytest.raises(ConfigError, match=r"bad config value for 'optim.lr': Value 'abc' .* Float$") as err:
        load_config("default", ["optim.lr=abc"])
    assert "\n" not in str(err.value)       # one line, without OmegaConf's internals
    with pytest.raises(ConfigError, match=r"profile.start_step=10 is not a step of this run \(steps 0..3\)"):
        load_config("default", ["steps=4", "profile.start_step=10"])
    with pytest.raises(ConfigError, match="unknown model 'llama9'"):
        load_config("default", ["model.name=llama9"])
    with pytest.raises(ConfigError, match="is not key=value"):
        load_config("default", ["steps"])
    with pytest.raises(ConfigError, match="no shipped config 'defualt'"):
        load_config("defualt")
    with pytest.raises(ConfigError, match="must be a multiple of model.n_kv_heads"):
        load_config("default", ["model.n_kv_heads=3"])
    with pytest.raises(ConfigError, match="model.remat='some'"):
        load_config("default", ["model.remat=some"])
    with pytest.raises(ConfigError, match="model.loss_logits_dtype='float16' must be float32 or bfloat16"):
        load_config("default", ["model.loss_logits_dtype=float16"])
    with pytest.raises(ConfigError, match=r"did you mean default\?\);"):    # the names, not a Python list
        load_config("defualt")
    bad = tmp_path / "bad.yaml"
    for text, message in (("model: [", "is not valid YAML"), ("- steps: 3", "must hold sections of key: value"),
                          ("model: tiny", "model must be a section of key: value, not 'tiny'")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message) as err:
            load_config(str(bad))
        assert "\n" not in str(err.value)
    if jax.default_backend() == "cpu":           # at load, not from inside the first step's trace
        with pytest.raises(ConfigError, match="model.attention=cudnn is not available on cpu; use model.attention=xla"):
            load_config("default", ["model.attention=cudnn"])


def test_unavailable_attention_is_an_error_not_a_fallback():
    from pallas_kernels.attention import resolve
    if jax.default_backend() == "cpu":
        with pytest.raises(RuntimeError, match="'cudnn' is not available on cpu"):
            resolve("cudnn")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        resolve("flash")


def test_plot_metrics_refuses_runs_without_step_rows(tmp_path, capsys):
    import json
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import plot_metrics
    empty, good = tmp_path / "empty", tmp_path / "good"
    for d, rows in ((empty, [{"event": "start", "step": 0}]),
                    (good, [{"event": "start", "step": 0}] + [{"step": s, "loss": 5.0 - s, "lr": 1e-3,
                                                               "tokens_per_s": 100.0, "mfu": None} for s in (1, 2)])):
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="no run to draw"):
        plot_metrics.plot([empty], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
    png = plot_metrics.plot([empty, good], tmp_path / "both.png")      # the run with rows is drawn, the other named
    assert png.stat().st_size > 10_000
    assert f"{empty}/metrics.jsonl has no step rows" in capsys.readouterr().err


def test_tensorboard_gets_step_rows_only(tmp_path):
    """A summary or start row is no point of a curve (its median tokens/s would join the per-step series)."""
    from meshlab.train.metrics import MetricsWriter
    got = []
    writer = MetricsWriter(tmp_path)
    writer.tb = type("TB", (), {"add_scalar": lambda self, k, v, s: got.append((k, v, s)), "close": lambda self: None})()
    writer.write({"event": "start", "step": 0, "time": 1.7e9})
    writer.write({"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "skipped": True})
    writer.write({"event": "summary", "step": 1, "tokens_per_s": 90.0, "from_step": 1})
    assert got == [("loss", 5.0, 1), ("tokens_per_s", 100.0, 1)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3     # the record keeps every row


@pytest.mark.parametrize("override,message", [("data.microbatches=0", "data.microbatches=0 must be >= 1"),
                                              ("log_every=0", "log_every=0 must be >= 1"),
                                              ("val.every=-1", r"val.every=-1 must be >= 0 \(0: off\)"),
                                              ("val.batches=0", "val.batches=0 must be >= 1"),
                                              ("model.n_layers=0", "model.n_layers=0 must be >= 1"),
                                              ("model.head_dim=0", "model.head_dim=0 must be >= 1"),
                                              ("model.mlp_dim=0", "model.mlp_dim=0 must be >= 1"),
                                              ("model.norm_eps=-1", r"model.norm_eps=-1.0 must be > 0"),
                                              ("optim.lr=-1", r"optim.lr=-1.0 must be > 0"),
                                              ("optim.b1=2", r"optim.b1=2.0 must be in \[0, 1\)"),
                                              ("optim.min_lr_ratio=5", r"optim.min_lr_ratio=5.0 must be in \[0, 1\]"),
                                              ("optim.decay_steps=-1", r"optim.decay_steps=-1 must be >= 0"),
                                              ("data.max_bytes=0", "data.max_bytes=0 must be >= 1")])
def test_counts_below_their_floor_stop_at_load(override, message):
    """Each stops at load with its key named, before any compile: otherwise a ZeroDivisionError (microbatches at
    the batch check, log_every after the first step), an XLA shape error (a zero size), a silent nonsense run (a
    negative learning rate, an Adam beta past 1) or optax's message about its own arguments."""
    with pytest.raises(ConfigError, match=message):
        load_config("default", [override])


def test_a_mixture_of_experts_under_a_pipeline_names_the_rule_files_that_run_it():
    with pytest.raises(ValueError, match=r"has no pipeline stages .* stage=1, e\.g\. under ep, fsdp_ep or fsdp_tp_ep"):
        build_trainer(small_config("pp_dp", extra=["model.name=moe_tiny"]))


@pytest.mark.parametrize("overrides,message", [
    (["device_memory_gib=nan"], "device_memory_gib=nan must be a finite number"),
    (["peak_tflops=inf"], "peak_tflops=inf must be a finite number"),
    (["optim.lr=inf"], "optim.lr=inf must be a finite number"),
    (["model.rope_theta=-1"], r"model.rope_theta=-1.0 must be > 0 \(RoPE's base wavelength\)"),
    (["model.rope_scaling_factor=8", "model.rope_low_freq_factor=0"],
     r"model.rope_low_freq_factor=0.0 and model.rope_high_freq_factor=4.0 must satisfy 0 < low < high"),
    (["model.rope_scaling_factor=8", "model.rope_original_max_position=0"],
     r"model.rope_original_max_position=0 must be >= 1 \(RoPE scaling is on"),
    (["seed=9223372036854775808"], r"seed=9223372036854775808 must be a whole number in \[0, 2\*\*32 - 1\]"),
    (["data.seed=-1"], r"data.seed=-1 must be a whole number in \[0, 2\*\*32 - 1\]"),
    (["steps=9223372036854775808"], r"steps=9223372036854775808 is out of range: at most 2\*\*31 - 1 = 2,147,483,647"),
    (["optim.warmup_steps=2147483648"], r"optim.warmup_steps=2147483648 is out of range"),
    (["model.vocab_size=9223372036854775808"], r"model.vocab_size=9223372036854775808 is out of range"),
    (["model.dtype=float16", "loss_scale_init=-1"], r"loss_scale_init=-1.0 must be > 0"),
    (["loss_scale_growth=0"], "loss_scale_growth=0 must be >= 1"),
    (["checkpoint.keep=-1"], r"checkpoint.keep=-1 must be >= 0 \(0: keep every checkpoint\)"),
    (["profile.start_step=-2"], r"profile.start_step=-2 must be >= -1 \(-1: no profile\)"),
    (["model.name=moe_tiny", "model.aux_loss_weight=-1"], r"model.aux_loss_weight=-1.0 must be >= 0 \(0: off\)"),
    (["checkpoint.at_end=2"], r"checkpoint.at_end=2 is a switch: true or false \(yes / no, on / off, 1 / 0\)"),
    (["data.seq_len=2"], r"sample_prompt='def ' is 4 tokens, which leaves no room in the end-of-run sample's context of "
                         r"2 x data.seq_len = 4; shorten it, raise data.seq_len, or set sample_tokens=0"),
    (["sample_prompt=@x"], r"""override 'sample_prompt=@x': the value '@x' is not valid YAML \(found character that cannot """
                           r"""start any token\); put it in single quotes inside the override, e.g. "sample_prompt='@x'\""""),
    (["mesh=="], "override 'mesh==': the value '=' is not valid YAML"),
])
def test_numbers_out_of_their_range_stop_at_load(overrides, message):
    """Each stops at load with its key named, before any compile: otherwise an OverflowError or YAML traceback, a
    ZeroDivisionError inside RoPE's scaling, a silent nonsense run (a non-finite learning rate or RoPE base, a switch
    given a count), or a run that trains and then fails on its sample."""
    with pytest.raises(ConfigError, match=message) as err:
        load_config("default", ["rules=dp", *overrides])
    assert "\n" not in str(err.value)


def test_edge_values_that_work_still_load():
    cfg = load_config("default", ["rules=dp", "checkpoint.at_end=0", "model.scan_layers=no", "seed=4294967295",
                                  "data.seq_len=2", "sample_tokens=0", "data.max_bytes=9223372036854775808",
                                  "checkpoint.keep=0", "sample_prompt='@x'"], resolve=False)
    assert (cfg.checkpoint.at_end, cfg.model.scan_layers, cfg.seed, cfg.sample_prompt) == (False, False, 2**32 - 1, "@x")
