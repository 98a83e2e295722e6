"""Packages only (the rest is pyproject.toml): agentbox and its subpackages, agentbox.kernels among them."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["agentbox", "agentbox.*"]), package_dir={"": "."})
