"""The scaled-down study: SFT -> RL on the bug-fixing task family, against controls.

    python -m experiments.binary_search_rl            # the whole study, CPU defaults
    python -m experiments.binary_search_rl --preset=gpu

See README.md in this directory.
"""
