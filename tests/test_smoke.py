import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from meshlab import compat


def test_eight_simulated_devices():
    assert len(jax.devices()) == 8


def test_set_cpu_devices_orders_cpu_collectives_and_keeps_the_users_flags(monkeypatch):
    """The simulated-device flags scripts and notebooks start with: the CPU scheduler under which
    shard_map collectives sharing one channel id deadlocked is off, unless the user chose it."""
    monkeypatch.setattr(compat, "unique_collective_channels", lambda: None)   # its own test: a subprocess
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    compat.set_cpu_devices(8)
    flags = os.environ["XLA_FLAGS"].split()
    assert compat.CPU_COLLECTIVE_ORDER in flags and "--xla_dump_to=/tmp/x" in flags
    chosen = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.setenv("XLA_FLAGS", chosen)
    compat.set_cpu_devices(8)
    flags = os.environ["XLA_FLAGS"].split()
    assert chosen in flags and compat.CPU_COLLECTIVE_ORDER not in flags


def test_set_cpu_devices_after_jax_started_says_so(monkeypatch):
    """In a notebook whose kernel already ran JAX the count cannot change: one error saying to restart,
    not a silent no-op that a later mesh error blames on the mesh."""
    monkeypatch.setattr(compat, "unique_collective_channels", lambda: None)
    monkeypatch.setenv("XLA_FLAGS", "")
    compat.set_cpu_devices(8)                                   # the count the tests started with: fine
    with pytest.raises(RuntimeError, match=r"set_cpu_devices\(4\): JAX has already started with 8 CPU device.*"
                                           r"restart the kernel"):
        compat.set_cpu_devices(4)


CHANNELS = """
import json, re, sys
from functools import partial
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from meshlab import compat
if sys.argv[1] == "on":
    compat.set_cpu_devices(8)
mesh = compat.make_mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
f = jax.jit(partial(jax.shard_map, mesh=mesh, in_specs=P("a", "b"), out_specs=P(None, "b"), check_vma=False)(
    lambda x: jax.lax.psum(x, "a") + jax.lax.psum(x * 2, "a") + jax.lax.all_gather(x, "a", tiled=True)[:1]))
print(json.dumps([re.findall(r"channel_handle<handle = (\\d+)", f.lower(jnp.ones((2, 4))).as_text()) for _ in range(2)]))
"""


def test_simulated_devices_give_each_collective_a_channel_of_its_own():
    """Under set_cpu_devices (scripts' --cpu-devices) two all-reduces and a gather over one device group
    lower with three channel ids, the same ones when lowered again (a compile-cache key holds); JAX's
    own lowering gives all three id 1 (meshlab.compat.unique_collective_channels says why that hangs)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ids = {}
    for mode in ("on", "off"):
        out = subprocess.run([sys.executable, "-c", CHANNELS, mode], capture_output=True, text=True, env=env,
                             timeout=120, cwd=root)
        assert out.returncode == 0, out.stderr[-2000:]
        ids[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    (a, b), (c, _) = ids["on"], ids["off"]
    assert len(set(a)) == len(a) == 3 and a == b and c == ["1", "1", "1"]
