"""jaxrl_agent: JAX-native agent reinforcement learning for language models.

Read order for a newcomer: losses/ -> advantages.py -> train/step.py -> agent/rollout.py -> env/;
the layers and the data flow are in ARCHITECTURE.md.
Importing the package has no side effects (no env vars, no JAX backend initialisation).
"""

__version__ = "0.1.0"
