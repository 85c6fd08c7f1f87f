import jax


def test_eight_simulated_devices():
    assert len(jax.devices()) == 8
