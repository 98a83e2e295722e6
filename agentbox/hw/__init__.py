"""The machine: owns the probe of this host and its GPUs (probe.py: memory, links, whether the GPU software
stack really loads) and described machines for `--hardware` (hardware.py). It imports nothing above it: hub/
plans models from its answers and cli/doctor.py turns them into advice."""
