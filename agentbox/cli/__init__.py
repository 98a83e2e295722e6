"""The command line: `agentbox` and its subcommands (main.py builds the app; one module per group of
commands), and the daemon that `serve` starts in the background (daemon.py). Nothing below agentbox/ imports
from here.
"""
