"""A short run of the default recipe (tiny, fsdp_tp, 8 devices): the loss falls clearly and the
run directory holds the resolved config, metrics, TensorBoard events, the plot and a sample."""
import json

import yaml

from meshlab.train.config import load_config
from meshlab.train.loop import train


def test_short_default_run_learns_and_writes_run_dir(tmp_path):
    cfg = load_config("default", ["steps=60", "log_every=20", "sample_tokens=20", f"run_dir={tmp_path}"])
    out = train(cfg, progress=False)
    losses = out["losses"]
    assert len(losses) == 60
    # Byte-level loss starts near ln(384) = 5.95; 60 steps of Python source get well under 3.5.
    assert losses[0] > 5.0 and losses[-1] < 3.5, (losses[0], losses[-1])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["event"] == "start"
    rows = [r for r in rows if "event" not in r]
    assert [r["step"] for r in rows] == [1, 20, 40, 60]          # first and final step always logged
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_ms"):
        assert all(key in r for r in rows), key
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["rules"] == "fsdp_tp" and resolved["model"]["name"] == "tiny" and resolved["steps"] == 60
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert any((tmp_path / "tb").iterdir())
    assert (tmp_path / "sample.txt").read_text().startswith(cfg.sample_prompt)


def test_logged_learning_rate_is_the_schedule_computed_on_the_host():
    """The loop logs optax's schedule from a table built once on the host CPU: a per-step call of the
    jnp schedule on the accelerator would wait for the step in flight (a device-idle gap every step)."""
    import numpy as np

    from meshlab.train.optimizer import OptimConfig, host_schedule, schedule
    cfg = OptimConfig(lr=3e-4, warmup_steps=10, min_lr_ratio=0.1)
    on_host, optax_fn = host_schedule(cfg, 50), schedule(cfg, 50)
    assert all(isinstance(on_host(i), float) for i in (0, 49))
    np.testing.assert_allclose([on_host(i) for i in range(50)], [float(optax_fn(i)) for i in range(50)], rtol=1e-6)
    blocks = host_schedule(cfg, 50, block=16)           # computed 16 steps at a time: the same values
    assert [blocks(i) for i in (*range(50), 3, 60, -1)] == [on_host(i) for i in (*range(50), 3, 60, -1)]
    assert host_schedule(cfg, 10**9)(10**9 - 1) == float(schedule(cfg, 10**9)(10**9 - 1))   # no table of 10^9 steps
