import os

import jax

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
