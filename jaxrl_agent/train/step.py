"""DEVICE: the jitted, sharded train step: one rollout batch -> PPO epochs x mini-batches of
AdamW updates. The only `value_and_grad` in the package.

    batch --(prepare: old_logp / old_values / ref_logp / advantages, no grad)-->
      for epoch, mini-batch: outputs = policy_outputs(params)   (ONCE per update)
                             loss, metrics = loss_fn(outputs, mini_batch, cfg.loss)
                             grads -> optax (clip, AdamW, schedule)

The step is a plain `jax.jit` over pure functions of a parameter dict (the NNX model is
rebuilt from its graphdef inside the trace with `nnx.merge`), with explicit in/out shardings
from `train/sharding.py`, so the same code runs on one device, a simulated 8-device CPU mesh,
several processes, or a pod.

Gradient accumulation is exact for every LossFn, not only for sums. A loss is a function of
the whole mini-batch's `PolicyOutputs` (its denominator counts tokens or rows over the whole
batch; group advantages and DPO pairs couple rows), while the expensive part (the model
forward / backward) is row-wise. So with `num_micro_batches = n`:
  1. the forward runs micro-batch by micro-batch (no grad) to get the full `[B, T]` outputs;
  2. the loss and its gradient g = dL/d(outputs) are computed once on the full batch: for a
     loss written num / den this is d num / d outputs divided by the *global* den;
  3. each micro-batch's forward is re-run under `jax.vjp` and g's rows are pulled back into
     parameter gradients, which are summed.
The sum equals the full-batch gradient up to float summation order; memory is one
micro-batch of activations plus `[B, T]` float outputs. The cost is one extra forward.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_agent.config import OptimConfig, TrainConfig
from jaxrl_agent.losses import kernels as L
from jaxrl_agent.losses.registry import ESTIMATORS, advantage_of, estimate_advantages
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.model.outputs import policy_outputs
from jaxrl_agent.program_store import StoredJit
from jaxrl_agent.structs import PolicyOutputs, TrainBatch
from jaxrl_agent.train import lora as lora_lib
from jaxrl_agent.train import micro_batches
from jaxrl_agent.train import sharding as sh

ADVANTAGES = ("loss", *ESTIMATORS)


# ---- optimizer ----
def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then constant / linear / cosine decay."""
    lr, decay_steps = cfg.learning_rate, max(cfg.total_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        main = optax.constant_schedule(lr)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(lr, lr * cfg.min_lr_ratio, decay_steps)
    elif cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, decay_steps, alpha=cfg.min_lr_ratio)
    else:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; expected constant, linear or cosine")
    if cfg.warmup_steps <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, cfg.warmup_steps), main], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping (optional) then AdamW on the schedule."""
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return adamw if cfg.max_grad_norm is None else optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


# ---- state ----
@struct.dataclass
class TrainState:
    """Everything a training run carries between steps (and checkpoints).

    params:    trained parameters: the model's pure param dict, or the LoRA adapters.
    opt_state: the optax state of `params`.
    step:      int32 scalar, train-step calls so far (rollout batches consumed).
    rng:       uint32 `[2]` raw PRNG key (mini-batch shuffling).
    frozen:    the frozen base weights under LoRA (also the reference policy), else None.
    ref:       a frozen copy of the initial params (full fine-tuning with `use_ref`), else None.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    frozen: Any = None
    ref: Any = None


class TrainStep:
    """A compiled train step and the shardings it was built for (see `make_train_step`).

    Attributes:
      mesh: the device mesh; state_shardings / batch_sharding: its in/out shardings.
      step: the `jax.jit` function `(TrainState, TrainBatch) -> (TrainState, metrics)`.
      grads: jitted `(TrainState, TrainBatch) -> (loss, metrics, grads)` (no update).
      outputs: jitted `(TrainState, TrainBatch) -> PolicyOutputs` of the current policy.

    `precompile(batches)` compiles the step for the batch shapes a run will use, in a background
    thread, the way `SamplingEngine.warmup` compiles the sampler's buckets: the first update then
    starts at once instead of compiling after the first rollout, and with the persistent
    compilation cache (cli/compile_cache.py) the compile is a disk load.
    """

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation, cfg: TrainConfig,
                 model: CausalLM, mesh: Mesh | None = None):
        if cfg.old_logp not in ("sampler", "recompute"):
            raise ValueError(f"old_logp must be 'sampler' or 'recompute', got {cfg.old_logp!r}")
        if cfg.advantage not in ADVANTAGES:
            raise ValueError(f"unknown advantage {cfg.advantage!r}; expected one of {ADVANTAGES}")
        if min(cfg.ppo_epochs, cfg.num_mini_batches, cfg.num_micro_batches) < 1:
            raise ValueError("ppo_epochs, num_mini_batches and num_micro_batches must be >= 1")
        self.loss_fn, self.optimizer, self.cfg = loss_fn, optimizer, cfg
        # One advantage path: an estimator sees the whole batch (its groups, its whitening), so
        # with mini-batches the loss's own estimator (LOSS_ADVANTAGES) runs once before the split.
        derived = advantage_of(loss_fn)
        self.advantage = derived if cfg.advantage == "loss" and cfg.num_mini_batches > 1 and derived else cfg.advantage
        self.mesh = sh.make_mesh(cfg.mesh) if mesh is None else mesh
        self.lora = cfg.lora.rank > 0
        self.has_critic = bool(model.config.value_head)
        traced = nnx.eval_shape(lambda: model)  # an abstract copy: the caller's model is not changed
        if cfg.remat and not traced.config.remat:
            traced.config = dataclasses.replace(traced.config, remat=True)
        self._graphdef, abstract = nnx.split(traced)
        self._abstract = abstract
        self.param_logical = {k: tuple(v) for k, v in nnx.to_pure_dict(nnx.get_partition_spec(abstract)).items()}
        self.param_shapes = nnx.to_pure_dict(abstract)
        preset = cfg.mesh.preset
        self.param_shardings = sh.param_shardings(self.param_logical, self.param_shapes, self.mesh, preset)
        sh.check_replication(self.param_shardings, self.param_shapes, cfg.mesh)
        if self.lora:
            lora_shapes = jax.eval_shape(lambda p: lora_lib.init_lora(p, cfg.lora, jax.random.key(0)), self.param_shapes)
            lora_logical = lora_lib.lora_logical_axes(self.param_logical, cfg.lora)
            self.trainable_shardings = sh.param_shardings(lora_logical, lora_shapes, self.mesh, preset)
            self.trainable_shapes = lora_shapes
        else:
            self.trainable_shardings, self.trainable_shapes = self.param_shardings, self.param_shapes
        repl = NamedSharding(self.mesh, P())
        opt_shapes = jax.eval_shape(optimizer.init, self.trainable_shapes)
        opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, self.trainable_shardings,
                                              transform_non_params=lambda _: repl)
        self.state_shardings = TrainState(
            params=self.trainable_shardings, opt_state=opt_shardings, step=repl, rng=repl,
            frozen=self.param_shardings if self.lora else None,
            ref=self.param_shardings if (cfg.use_ref and not self.lora) else None)
        self.batch_sharding = sh.batch_sharding(self.mesh)
        # the log-prob chunk skip is a lax.cond: not on a CPU mesh (sharding.py says why)
        self._chunk_skip = cfg.logp_loss_chunks_only and sh.control_flow_may_hold_collectives(self.mesh)
        self._gather_policy = None
        self._compiled: dict = {}  # batch signature -> Future of the step compiled for it
        self._compiler = None
        self.replicated = repl
        in_sh = (self.state_shardings, self.batch_sharding)
        self._xla = dict(cfg.compiler_options) or None
        # The step's programs are kept on disk by batch shape (program_store.py): a warm start
        # loads them without tracing. The key holds everything the trace reads from this object.
        self._stored = StoredJit(self._step, "train_step", (
            loss_fn, optimizer, cfg, self.mesh, self._graphdef, self.param_shapes, self.param_logical,
            self.advantage, self.has_critic), in_shardings=in_sh, out_shardings=(self.state_shardings, repl),
            donate_argnums=0, compiler_options=self._xla)
        self.step = self._stored.jitted
        self.grads = jax.jit(self._grads_only, in_shardings=in_sh, out_shardings=(repl, repl, self.trainable_shardings),
                             compiler_options=self._xla)
        self.outputs = jax.jit(lambda s, b: self._outputs(self._policy(s.params, s.frozen), b),
                               in_shardings=in_sh, out_shardings=self.batch_sharding, compiler_options=self._xla)

    # ---- state ----
    def init_state(self, model: CausalLM, seed: int = 0) -> TrainState:
        """Place the model's params (and adapters, reference copy, optimizer state) on the mesh."""
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        # A copy, never an alias: the step donates its state, which must not free the model's arrays.
        # (device_put may reuse the buffer on device 0 even with may_alias=False; a jitted copy never does.)
        # One jitted copy of the whole tree, used for the reference copy too: an eager
        # tree.map(jnp.copy) compiles one small program per distinct leaf shape.
        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings,
                       compiler_options=self._xla)
        params = copy(params)
        key = jax.random.PRNGKey(seed)
        if self.lora:
            init = jax.jit(lambda p: lora_lib.init_lora(p, self.cfg.lora, jax.random.fold_in(key, 1)),
                           out_shardings=self.trainable_shardings, compiler_options=self._xla)
            trainable, frozen = init(params), params
        else:
            trainable, frozen = params, None
        ref = copy(params) if (self.cfg.use_ref and not self.lora) else None
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_shardings.opt_state,
                            compiler_options=self._xla)(trainable)
        state = TrainState(params=trainable, opt_state=opt_state, step=jnp.zeros((), jnp.int32), rng=key,
                           frozen=frozen, ref=ref)
        return jax.device_put(state, self.state_shardings)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs (with shardings) of a TrainState: the restore target for orbax."""
        shapes = jax.eval_shape(lambda: TrainState(
            params=self.trainable_shapes, opt_state=self.optimizer.init(self.trainable_shapes),
            step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(0),
            frozen=self.param_shapes if self.lora else None,
            ref=self.param_shapes if (self.cfg.use_ref and not self.lora) else None))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, self.state_shardings)

    def policy_params(self, state: TrainState) -> dict:
        """The full parameter dict of the current policy (LoRA merged into the base)."""
        return self._policy(state.params, state.frozen)

    def host_policy_params(self, state: TrainState) -> dict:
        """`policy_params(state)` as NumPy arrays on the host (gathered replicated, so every
        process of a multi-host job reads a whole local copy): for export and the sampler."""
        if self._gather_policy is None:  # compiled once, reused every RL iteration
            self._gather_policy = jax.jit(self.policy_params, out_shardings=self.replicated)
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), self._gather_policy(state))

    def to_model(self, params: dict) -> CausalLM:
        """An NNX model holding `params` (a full param dict, e.g. `policy_params(state)`)."""
        return self._model(params)

    def __call__(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
        """Run the jitted step (the precompiled one when `precompile` built this batch's shape);
        a host (NumPy) batch is sharded first."""
        if not isinstance(batch.tokens, jax.Array):
            batch = sh.shard_batch(batch, self.mesh)
        future = self._compiled.get(_signature(batch))
        if future is not None and not future.cancelled() and future.exception() is None:  # waits if in flight
            return future.result()(state, batch)
        return self._stored(state, batch)

    def precompile(self, batches) -> list:
        """Compile the step, in a background thread, for each host batch's shapes (its rows are
        this process's, as `sharding.shard_local_batch` takes them); returns the compiles'
        Futures. A compile that fails leaves that shape to the ordinary jit, which reports the
        error when such a batch arrives."""
        from concurrent.futures import ThreadPoolExecutor

        if self._compiler is None:  # one thread: compiles queue behind each other
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="jxa-precompile")
        state, futures = self.abstract_state(), []
        for batch in batches:
            glob = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * jax.process_count(), *x.shape[1:]),
                                                               x.dtype, sharding=self.batch_sharding), batch)
            key = _signature(glob)
            if key not in self._compiled:
                self._compiled[key] = self._compiler.submit(lambda g=glob: self._stored.program(state, g))
            futures.append(self._compiled[key])
        return futures

    def stop_precompiling(self) -> None:
        """Drop the compiles not started yet: a run that ends early (no signal, Ctrl-C) does not
        wait for them at exit. At most the one in flight finishes."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None
            self._compiled = {k: f for k, f in self._compiled.items() if not f.cancelled()}

    # ---- pure pieces (traced inside the jits) ----
    def _policy(self, trainable, frozen) -> dict:
        return lora_lib.apply_lora(frozen, trainable, self.cfg.lora) if self.lora else trainable

    def _model(self, params: dict) -> CausalLM:
        state = jax.tree.map(lambda x: x, self._abstract)  # fresh Variables for this trace
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self._graphdef, state)

    def _forward(self, params: dict, rows: TrainBatch) -> PolicyOutputs:
        rows = jax.lax.with_sharding_constraint(rows, self.batch_sharding)
        return policy_outputs(self._model(params), rows.tokens, rows.positions, rows.attention_mask,
                              chunk_size=self.cfg.logp_chunk_size,
                              loss_mask=rows.loss_mask if self._chunk_skip else None,
                              prefix=rows.prefix, packed=rows.packed)

    def _outputs(self, params: dict, batch: TrainBatch) -> PolicyOutputs:
        """PolicyOutputs of the full batch, computed micro-batch by micro-batch (no grad)."""
        n = self._micro(batch)
        if n == 1:
            return self._forward(params, batch)
        micro, shared = micro_batches.split_rows(batch, n)
        outs = jax.lax.map(lambda rows: self._forward(params, rows.replace(**shared)), micro)
        return jax.tree.map(micro_batches.unsplit, outs)

    def _micro(self, batch: TrainBatch) -> int:
        n, b, k = self.cfg.num_micro_batches, batch.tokens.shape[0], sh.batch_size_multiple(self.mesh)
        if b % n or (b // n) % k:
            raise ValueError(f"a mini-batch of {b} rows cannot be cut into {n} micro-batches of a multiple of "
                             f"data*fsdp={k} rows")
        return n

    def _prepare(self, state: TrainState, batch: TrainBatch) -> TrainBatch:
        """Fill what the rollout batch lacks before the first update (all without grad)."""
        cfg = self.cfg
        need_old = cfg.old_logp == "recompute" and batch.old_logp is None
        need_values = self.has_critic and batch.old_values is None
        if need_old or need_values:
            out = self._outputs(self._policy(state.params, state.frozen), batch)
            batch = batch.replace(old_logp=out.logp if need_old else batch.old_logp,
                                  old_values=out.values if need_values else batch.old_values)
        if cfg.use_ref and batch.ref_logp is None:
            ref_params = state.frozen if self.lora else state.ref
            batch = batch.replace(ref_logp=self._outputs(ref_params, batch).logp)
        if cfg.loss.kl_coef and batch.ref_logp is None:  # the KL term would silently be 0
            raise ValueError(f"loss.kl_coef={cfg.loss.kl_coef} needs reference log-probs, but the batch has no "
                             "ref_logp and train.use_ref is false: set train.use_ref=true (the frozen initial "
                             "policy, or the LoRA base) or pass ref_logp in the batch")
        if self.advantage != "loss" and batch.advantages is None:
            advantages, returns = estimate_advantages(batch, self.advantage, cfg.loss)
            batch = batch.replace(advantages=advantages, returns=returns)
        return jax.lax.stop_gradient(batch)

    def _loss_and_grads(self, trainable, frozen, batch: TrainBatch):
        """(loss, metrics, grads) of one mini-batch, accumulated exactly over micro-batches."""
        cfg, n = self.cfg, self._micro(batch)

        def loss_of_outputs(out):
            return self.loss_fn(out, batch, cfg.loss)

        if n == 1:
            def loss_of_params(p):
                out = self._forward(self._policy(p, frozen), batch)
                loss, metrics = loss_of_outputs(out)
                return loss, (metrics, out)

            (loss, (metrics, out)), grads = jax.value_and_grad(loss_of_params, has_aux=True)(trainable)
        else:
            out = self._outputs(self._policy(trainable, frozen), batch)  # pass 1: [B, T], no grad
            (loss, metrics), g_out = jax.value_and_grad(loss_of_outputs, has_aux=True)(out)
            micro, shared = micro_batches.split_rows(batch, n)
            g_micro = jax.tree.map(lambda x: micro_batches.split(x, n), g_out)

            def pull_back(acc, xs):  # pass 2: vjp of one micro-batch's forward with its rows of g
                rows, g_rows = xs
                rows = rows.replace(**shared)
                _, vjp = jax.vjp(lambda p: self._forward(self._policy(p, frozen), rows), trainable)
                return jax.tree.map(jnp.add, acc, vjp(g_rows)[0]), None

            zeros = jax.tree.map(jnp.zeros_like, trainable)
            grads, _ = jax.lax.scan(pull_back, zeros, (micro, g_micro))
        metrics = dict(metrics)
        metrics.update(_gap_metrics(out.logp, batch))
        metrics["grad_norm"] = optax.tree.norm(grads)
        return loss, metrics, grads

    def _grads_only(self, state: TrainState, batch: TrainBatch):
        batch = self._prepare(state, batch)
        return self._loss_and_grads(state.params, state.frozen, batch)

    def _step(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
        cfg = self.cfg
        batch = self._prepare(state, batch)
        b, m = batch.tokens.shape[0], cfg.num_mini_batches
        if b % m:
            raise ValueError(f"batch of {b} rows is not divisible into {m} mini-batches")
        rng, shuffle_key = jax.random.split(state.rng)
        if m == 1:  # the whole batch is the mini-batch: order is irrelevant, skip the gather
            order = jnp.broadcast_to(jnp.arange(b), (cfg.ppo_epochs, b))
        elif cfg.shuffle:
            keys = jax.random.split(shuffle_key, cfg.ppo_epochs)
            order = jax.vmap(lambda k: jax.random.permutation(k, b))(keys)
        else:
            order = jnp.broadcast_to(jnp.arange(b), (cfg.ppo_epochs, b))
        order = order.reshape(cfg.ppo_epochs * m, b // m)  # [updates, rows]

        def update(carry, rows):
            params, opt_state = carry
            mb = batch if m == 1 else jax.lax.with_sharding_constraint(
                micro_batches.map_rows(lambda x: x[rows], batch), self.batch_sharding)
            loss, metrics, grads = self._loss_and_grads(params, state.frozen, mb)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            metrics["update_norm"] = optax.tree.norm(updates)
            return (optax.apply_updates(params, updates), opt_state), metrics

        (params, opt_state), per_update = jax.lax.scan(update, (state.params, state.opt_state), order)
        metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), per_update)
        # The sampler-vs-trainer gap is meaningful for the parameters that collected the data.
        for k in ("logp_gap_mean", "logp_gap_max"):
            metrics[k] = per_update[k][0]
        metrics["num_updates"] = jnp.asarray(order.shape[0], jnp.int32)
        new = state.replace(params=params, opt_state=opt_state, step=state.step + 1, rng=rng)
        return new, metrics


def _signature(batch) -> tuple:
    """What a compiled step is specialised to: the batch's tree and its leaves' shapes and dtypes."""
    return jax.tree.structure(batch), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch))


def _gap_metrics(logp: jax.Array, batch: TrainBatch) -> dict:
    """|logp - sampler_logp| on policy tokens: the sampler / trainer numerics mismatch."""
    gap = jnp.abs(logp - batch.sampler_logp)
    m = batch.loss_mask
    return {"logp_gap_mean": L.masked_mean(gap, m),
            "logp_gap_max": jnp.max(jnp.where(m > 0, gap, 0.0), initial=0.0),
            "policy_tokens": jnp.sum(m).astype(jnp.float32)}


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, cfg: TrainConfig, model: CausalLM,
                    mesh: Mesh | None = None) -> TrainStep:
    """Build the sharded, jitted train step for `model`'s architecture.

    Args:
      loss_fn: a `LossFn` `(PolicyOutputs, TrainBatch, LossConfig) -> (loss, metrics)`.
      optimizer: an optax transformation (`make_optimizer(OptimConfig)` for AdamW + clipping).
      cfg: `TrainConfig` (loss config, mesh / preset, LoRA, epochs, mini / micro-batches,
        old_logp source, reference policy, advantage estimator).
      model: a concrete or abstract (`nnx.eval_shape`) `CausalLM`; only its structure is kept.
      mesh: a prebuilt mesh (default: `sharding.make_mesh(cfg.mesh)`).
    Returns:
      A `TrainStep`: `ts.init_state(model, seed) -> TrainState`, then
      `state, metrics = ts(state, batch)` with `batch` a host or sharded `TrainBatch`;
      `ts.step` is the underlying `jax.jit` (state donated). `metrics` are replicated f32
      scalars: the LossFn's own (loss terms, KL, entropy, clip fractions, ratio stats, ...)
      plus grad_norm, update_norm, policy_tokens, averaged over the ppo_epochs x
      num_mini_batches updates, and logp_gap_mean / logp_gap_max (|logp - sampler_logp| on
      policy tokens) of the first update, i.e. at the parameters that collected the batch.
    """
    return TrainStep(loss_fn, optimizer, cfg, model, mesh)
