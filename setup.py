"""Packages only (the rest is pyproject.toml): agentbox and its subpackages, agentbox.kernels among them.

`package_dir={"": "."}` makes setuptools' editable install a plain .pth file; without it setuptools picks its
import-finder mode and prints a "!!" warning block about folders shadowing the package in every ./install.sh."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["agentbox", "agentbox.*"]), package_dir={"": "."})
