"""Packages only (the rest is pyproject.toml). The top-level kernels/ folder is the package `agentbox.kernels`:
`package_dir` maps it there for the wheel and for the editable install alike (kernels/__init__.py says more),
so code imports `agentbox.kernels.x`, never `kernels.x`."""

from setuptools import find_packages, setup

kernels = ["agentbox.kernels" + p[len("kernels"):] for p in find_packages(include=["kernels", "kernels.*"])]
setup(
    packages=[*find_packages(include=["agentbox", "agentbox.*"]), *kernels],
    package_dir={"agentbox.kernels": "kernels"},
)
