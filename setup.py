"""Packages only (the rest is pyproject.toml): kernels/ lives at the top level and ships as agentbox.kernels."""

from setuptools import find_packages, setup

kernels = ["agentbox.kernels" + p[len("kernels"):] for p in find_packages(include=["kernels", "kernels.*"])]
setup(
    packages=[*find_packages(include=["agentbox", "agentbox.*"]), *kernels],
    package_dir={"agentbox.kernels": "kernels"},
)
