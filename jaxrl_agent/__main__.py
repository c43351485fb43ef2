"""`python -m jaxrl_agent <command>`: see jaxrl_agent/cli.py."""
import sys

from jaxrl_agent.malloc_env import reexec_with_tcmalloc

# The guard matters: the sandbox starts its workers with multiprocessing "spawn", which
# re-imports the main module in each child.
if __name__ == "__main__":
    reexec_with_tcmalloc()  # before JAX starts: see malloc_env.py
    from jaxrl_agent.cli import main

    sys.exit(main())
