"""HOST: orbax checkpoints of a training run, and export to a Hugging Face directory.

The only module that imports orbax. A checkpoint is one directory per step holding
  state: the `TrainState` (params or LoRA adapters, frozen base, reference copy, optimizer
         state, step counter, RNG key), saved shard by shard from wherever it lives;
  meta:  JSON with the data / task-iterator position, the run's config and free extras.
orbax writes each step into a temporary directory and renames it when complete, so a run
killed mid-save leaves the previous checkpoint intact (atomic); only the last
`max_to_keep` steps are kept. Restoring takes the abstract state of a `TrainStep` (shapes,
dtypes and shardings), so arrays come back sharded for the current mesh.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxrl_agent import hf
from jaxrl_agent.config import CheckpointConfig


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def config_to_json(cfg: Any) -> Any:
    """Frozen dataclass configs (nested) -> JSON-able dicts; tuples become lists."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_json(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [config_to_json(x) for x in cfg]
    if isinstance(cfg, dict):
        return {str(k): config_to_json(v) for k, v in cfg.items()}
    return cfg


class Checkpointer:
    """Save / resume a run under `cfg.directory` (one sub-directory per step).

    Usage:
        ckpt = Checkpointer(CheckpointConfig(directory=...))
        ckpt.save(step, state, data_position={...}, config=train_cfg)
        state, meta = ckpt.restore(train_step.abstract_state())   # latest step
    """

    def __init__(self, cfg: CheckpointConfig):
        if cfg.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {cfg.max_to_keep}")
        if cfg.save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {cfg.save_every}")
        self.cfg = cfg
        self.directory = os.path.abspath(cfg.directory)
        self._opened = None

    @property
    def _manager(self):
        """orbax's manager, made (and orbax imported, `python -X importtime`) at the first query, save or restore:
        a run that saves only at its end does not wait for it before its first iteration."""
        if self._opened is None:
            ocp = _orbax()
            options = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.max_to_keep, create=True,
                                                   enable_async_checkpointing=False)
            self._opened = ocp.CheckpointManager(self.directory, options=options)
        return self._opened

    # ---- queries ----
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the kept checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        """True every `save_every` steps."""
        return step % self.cfg.save_every == 0

    # ---- save / restore ----
    def save(self, step: int, state, *, data_position: dict | None = None, config: Any = None,
             extra: dict | None = None) -> None:
        """Write checkpoint `step` (blocking until it is complete on disk).

        Args:
          step: the run's step counter (directory name).
          state: a `TrainState` (any pytree of jax arrays works).
          data_position: JSON-able position of the data / task iterator.
          config: the run's config (dataclass or dict), stored as JSON for provenance.
          extra: any further JSON-able values (metrics, wall time, ...).
        """
        meta = {"data_position": data_position or {}, "config": config_to_json(config), "extra": config_to_json(extra or {})}
        ocp = _orbax()
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(int(step), args=args, force=True)
        self._manager.wait_until_finished()

    def restore(self, abstract_state, step: int | None = None) -> tuple[Any, dict]:
        """Load checkpoint `step` (default: the latest) into the layout of `abstract_state`.

        Args:
          abstract_state: pytree of `jax.ShapeDtypeStruct`s with shardings
            (`TrainStep.abstract_state()`).
        Returns:
          (state, meta) with meta keys "data_position", "config", "extra".
        Raises:
          FileNotFoundError when the directory holds no checkpoint (or not `step`).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint under {self.directory}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} under {self.directory} "
                                    f"(have {self.all_steps()})")
        ocp = _orbax()
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        out = self._manager.restore(int(step), args=args)
        return out.state, dict(out.meta)

    def close(self) -> None:
        """Finish pending writes and release the manager (if one was made)."""
        if self._opened is not None:
            self._opened.wait_until_finished()
            self._opened.close()
            self._opened = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- export ----
def export_hf(train_step, state, model_config, path: str, tokenizer=None, write: bool = True) -> None:
    """Write the current policy (LoRA merged into its base) as an HF checkpoint directory.

    Args: train_step: the `TrainStep` the state belongs to; state: its `TrainState`;
      model_config: the `ModelConfig`; path: output directory (`transformers` loads it);
      tokenizer: written beside the weights when given (see `hf.save_pretrained`);
      write: False takes part in gathering the parameters (a collective on a multi-process
        job: every process must call this) but writes nothing.
    """
    params = train_step.host_policy_params(state)
    if write:
        hf.save_pretrained(train_step.to_model(params), model_config, path, tokenizer=tokenizer)
