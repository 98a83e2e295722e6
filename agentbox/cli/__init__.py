"""The command line: owns the `agentbox` command and its subcommands (main.py builds the app and holds the
serving commands; bench.py, workstation.py and fleet.py one group each), the daemon that `serve` starts in the
background (daemon.py) and `agentbox doctor` (doctor.py). It sits at the top: it may import every package, and
of the rest only tui/machine.py imports from here (the daemon's state file, to find a local server's pid).
"""
