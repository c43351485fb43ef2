"""`python -m jaxrl_agent <command>`: see jaxrl_agent/cli.py."""
import sys

from jaxrl_agent.cli import main

# The guard matters: the sandbox starts its workers with multiprocessing "spawn", which
# re-imports the main module in each child.
if __name__ == "__main__":
    sys.exit(main())
