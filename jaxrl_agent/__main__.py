"""`python -m jaxrl_agent <command>`: see jaxrl_agent/cli.py."""
import sys

from jaxrl_agent.cli import main

sys.exit(main())
