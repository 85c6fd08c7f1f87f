import os

import jax
import numpy as np

from meshlab import compat


def test_eight_simulated_devices():
    assert len(jax.devices()) == 8


def test_set_cpu_devices_orders_cpu_collectives_and_keeps_the_users_flags(monkeypatch):
    """The simulated-device flags scripts and notebooks start with: the CPU scheduler under which
    shard_map collectives sharing one channel id deadlocked is off, unless the user chose it."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    compat.set_cpu_devices(8)
    flags = os.environ["XLA_FLAGS"].split()
    assert compat.CPU_COLLECTIVE_ORDER in flags and "--xla_dump_to=/tmp/x" in flags
    chosen = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.setenv("XLA_FLAGS", chosen)
    compat.set_cpu_devices(8)
    flags = os.environ["XLA_FLAGS"].split()
    assert chosen in flags and compat.CPU_COLLECTIVE_ORDER not in flags


def test_each_collective_has_a_channel_of_its_own():
    """The simulated devices' collectives (meshlab.compat.unique_collective_channels, which the tests and
    scripts with --cpu-devices lower under): two equal all-reduces and a gather over one device group
    carry three channel ids, the same ones when lowered again (a program's compile-cache key holds)."""
    import re
    from functools import partial

    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = compat.make_mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("a", "b"), out_specs=P(None, "b"), check_vma=False)
    def f(x):
        return jax.lax.psum(x, "a") + jax.lax.psum(x, "a") + jax.lax.all_gather(x, "a", tiled=True)[:1]

    x = jnp.ones((2, 4))
    ids = [re.findall(r"channel_handle<handle = (\d+)", f.lower(x).as_text()) for _ in range(2)]
    assert len(set(ids[0])) == len(ids[0]) == 3 and ids[0] == ids[1]
    assert len(set(re.findall(r"channel_id=(\d+)", f.lower(x).compile().as_text()))) >= 2   # XLA may merge the equal two
