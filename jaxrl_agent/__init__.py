"""jaxrl_agent: JAX-native agent reinforcement learning for language models.

Read order for a newcomer: losses.py -> advantages.py -> train_step.py -> rollout.py -> env/.
Importing the package has no side effects (no env vars, no JAX backend initialisation).
"""

__version__ = "0.1.0"
