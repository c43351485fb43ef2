"""The environment (HOST): tasks, tools, sandbox, verifier, scripted expert.

- `tasks`      Task dataclass, the canonical binary-search task, the templated bug-fix
               family (`templates/`), splits, JSONL io
- `tool_calls` tool schemas, the Hermes tool-call text format and its parser
- `tools`      tools over a workspace and the episode session (limits, terminations)
- `sandbox`    process-isolated execution of untrusted code (pool of workers; `jail`,
               `sandbox_worker`, `sandbox_io`, `seccomp` and `pytest_plugin` are its
               internals)
- `judge`      the judge side of a verify: hidden tests whose imports of the task's
               modules are proxies; `code_server` answers them as plain data in the jail
- `verifier`   independent judge of a final workspace -> reward
- `expert`     scripted demonstrator for SFT data and baselines

Nothing is imported here: sandbox workers import `jaxrl_agent.env.jail` and must stay light
(no JAX), and every entry point lives in its own module (DESIGN §11).
"""
