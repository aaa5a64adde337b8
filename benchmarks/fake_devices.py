# The programs of benchmarks/ that compile for GPUs on fake CPU devices (as MaxText's train_compile.py
# compiles for hardware it does not have) call this before jax is imported: XLA reads both variables
# when its CPU backend starts.
import os


def use_fake_cpu_devices(count: int = 8) -> None:
    """Ask XLA for `count` host devices (unless XLA_FLAGS already sets a count) and JAX for the CPU."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
