"""`python -m jaxrl_agent <command>`: see jaxrl_agent/cli/main.py."""
import sys

from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc

# The usual guard (the sandbox's workers are separate interpreters started with
# `python -m jaxrl_agent.env.sandbox_worker`; they never import this module).
if __name__ == "__main__":
    reexec_with_tcmalloc()  # before JAX starts: see cli/malloc_env.py
    from jaxrl_agent.cli.main import main

    sys.exit(main())
