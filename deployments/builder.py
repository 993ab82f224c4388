"""The one place an engine is assembled: EngineConfig -> target, chain, scheduler, cost model, companions.

Every mode goes through `build_engine`:

- in-process (`LocalEngine`: `specray generate`, `specray bench`) and the
  co-located replica: the target context, the draft model and the hidden-state
  heads are opened here, in this process;
- distributed: the target and companion actors are started by the caller
  (`actors.launch.start_actors`, which also serves the hidden-row bench) and
  handed in; this process keeps a vocabulary-only model (tokenize and
  detokenize), a `RemoteTarget` proxy and the model-free speculators, and the
  model speculators become proxies of the companion.

The actors open their own llama.cpp contexts with `open_target` and the heads'
helpers below, so a target is opened the same way whichever process holds it.
The config's validators hold the rules (exact mode, flash attention, weight
repacking); nothing here re-checks them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.rollback import StateRollback, TargetMemory, rollback_mode, wants_snapshots
from specray.engine.scheduler import Scheduler
from specray.engine.speculators.registry import Factory, speculator_factory

log = logging.getLogger("specray.builder")


@dataclass
class EngineParts:
    """An assembled engine. `ctx`/`runner`/`draft_model`/`hidden_heads` are set when the target runs in this
    process; `remote`/`actors` when it runs in a target actor."""

    config: EngineConfig
    model: Any  # native Model: with weights in-process, vocabulary only when the target is an actor
    chain: Chain
    scheduler: Scheduler
    n_ctx: int  # cells of the whole context
    n_ctx_seq: int  # cells one sequence may use
    speculator_factory: Factory  # builds the chain's speculators (the bench runs several chains on one target)
    ctx: Any = None
    runner: Any = None  # engine.target.TargetRunner
    draft_model: Any = None
    hidden_heads: Any = None
    remote: Any = None  # actors.target.RemoteTarget
    actors: Any = None  # actors.launch.Actors

    @property
    def target(self):
        return self.runner if self.runner is not None else self.remote

    def close(self) -> None:
        """Free what this process opened (the actors belong to whoever started them)."""
        if self.draft_model is not None:
            self.draft_model.close()
        if self.hidden_heads is not None:
            self.hidden_heads.close()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.ctx is not None:
            self.ctx.close()


def open_target(config: EngineConfig, model=None):
    """(Model, Context) of the target, as the config says (in this process or in the target actor)."""
    from specray.native.context import Context
    from specray.native.model import Model

    model = model or Model(
        config.model,
        n_gpu_layers=config.n_gpu_layers,
        main_gpu=config.main_gpu,
        split_mode=config.split_mode,
        tensor_split=config.tensor_split,
        use_extra_bufts=config.repack_weights,
        chat_template=config.chat_template,
        load_mtp=config.hidden.mtp,  # a co-located MTP head shares these weights
    )
    # recurrent-state snapshots for llama.cpp's partial rollback (engine/rollback.py), asked for only where they
    # can serve: every decode writes them, drafted or not
    snapshots = wants_snapshots(model.memory_kind, config.rollback, config.slots, config.chain.enabled)
    branches = tree_seqs(config, model.memory_kind)
    ctx = Context(model, n_ctx=config.n_ctx, n_seq_max=config.slots + branches, n_batch=config.n_batch,
                  n_threads=config.threads, flash_attn=config.flash_attn_on, exact=config.exact,
                  n_rs_seq=config.rollback_snapshots if snapshots else 0)
    return model, ctx


def tree_seqs(config: EngineConfig, memory_kind: str) -> int:
    """Sequence ids for draft trees' branches beyond the slots (engine/draft_tree.py): slots x tree_branches where
    the chain sends trees (ChainConfig.trees) and this layout verifies them, else 0. A branch's rows carry several
    sequence ids at once, which llama.cpp allows in one KV pool only (not exact mode's stream per slot, whose
    output must not move with where a runner-up's cells lie); a recurrent state cannot fork per branch; padded
    verifies would put pad rows among a tree's; only the cost policy prices branches.

    >>> on = ChainConfig(trees=True)
    >>> tree_seqs(EngineConfig(slots=4, chain=on), "attention"), tree_seqs(EngineConfig(slots=4), "attention")
    (12, 0)
    >>> tree_seqs(EngineConfig(slots=1, exact=True, chain=on), "attention")   # exact mode: a KV stream per slot
    0
    >>> tree_seqs(EngineConfig(slots=4, flash_attn=False, chain=on), "attention")   # one pool, fast mode
    12
    >>> tree_seqs(EngineConfig(slots=4, chain=on), "hybrid"), tree_seqs(EngineConfig(slots=100, chain=on), "attention")
    (0, 156)
    """
    if (config.tree_branches == 0 or not config.chain.trees or config.exact
            or memory_kind != "attention" or config.shape_buckets is not None or config.chain.policy != "cost"):
        return 0
    return min(config.slots * config.tree_branches, 256 - config.slots)


def target_memory(config: EngineConfig, model, ctx) -> TargetMemory:
    """The target's memory kind and how it takes rejected drafts back (rollback.rollback_mode). Raises ValueError
    for rollback 'snapshots' on an architecture without them."""
    # an engine without a chain of its own asked for no snapshots (open_target): its requests' drafts, if any,
    # are rolled back by checkpoint whatever was asked
    requested = "checkpoint" if config.rollback == "snapshots" and not config.chain.enabled else config.rollback
    mode = rollback_mode(model.memory_kind, requested, ctx.n_rs_seq, config.slots)
    # tile pads need rows whose cells can be dropped again: an attention cache trimmed by position
    tile = (getattr(ctx, "attention_tile_rows", 0)
            if config.tile_pads and mode == "trim" and model.memory_kind == "attention" else 0)
    return TargetMemory(model.memory_kind, mode, ctx.n_rs_seq if mode == "snapshots" else 0,
                        can_shift=model.memory_kind == "attention" and ctx.can_shift,
                        tree_seqs=max(0, ctx.n_seq_max - config.slots) if mode == "trim" else 0,
                        attention_tile=tile)


def target_runner(config: EngineConfig, model, ctx):
    """The target's TargetRunner (in this process or in the target actor): the one place it is made."""
    from specray.engine.target import TargetRunner

    memory = target_memory(config, model, ctx)
    checkpoints = None
    if memory.rollback == "checkpoint":
        from specray.native.checkpoints import SeqCheckpoints

        checkpoints = SeqCheckpoints(ctx)
    buckets = config.shape_buckets
    if buckets is not None and memory.rollback != "trim":
        log.warning("verify_shape bucketed is off for this %s target: every pad row would roll its state back",
                    memory.kind)
        buckets = None
    from specray.native.grammar import GrammarCompiler

    return TargetRunner(ctx, record_margins=config.record_margins, verify_buckets=buckets,
                        rollback=StateRollback(memory.rollback, checkpoints),
                        constraints=GrammarCompiler.of(model),
                        branch_seqs=range(config.slots, config.slots + memory.tree_seqs),
                        attention_tile=memory.attention_tile), memory


def open_draft(config: EngineConfig, target, target_ctx):
    """The draft model of the `draft` speculator (None if none is configured). Checks the vocabularies:
    an incompatible pair raises VocabMismatchError unless config.draft.cross_vocab."""
    if not config.draft.model:
        return None
    from specray.native.backends import BACKENDS

    return BACKENDS["draft"].open(config, target, target_n_ctx=target_ctx.n_ctx)


def open_hidden(config: EngineConfig, target, target_ctx, runner):
    """The heads of the hidden-state speculators (mtp, eagle3, dflash; None if none is configured), in-process; the
    runner's target context is given the hidden-row taps they read (switched on only when needed)."""
    if not config.hidden.enabled:
        return None
    from specray.native.hidden import HiddenOutput
    from specray.native.hidden_heads import open_hidden_heads

    heads = open_hidden_heads(config, target, target_n_ctx=target_ctx.n_ctx, target_model=target)
    runner.hidden_out = HiddenOutput(target_ctx, heads.taps)
    return heads


def grammar_builders(model) -> dict:
    """The `grammar` speculator's builder: it drafts on the vocabulary of `model` (the target, or the router's
    vocabulary-only copy of it)."""
    from specray.engine.speculators.grammar import GrammarSpeculator
    from specray.native.grammar import GrammarCompiler

    tools = GrammarCompiler.of(model)
    return {"grammar": lambda p: GrammarSpeculator(p, tools)}


def local_speculator_factory(draft_model, hidden_heads=None, model=None) -> Factory:
    """Chain factory of an in-process engine: model speculators run on `draft_model` and the hidden-state
    heads (their rows come from the target in-process, without a copy); `grammar` on `model`'s vocabulary."""
    builders = {"draft": draft_model.speculator} if draft_model is not None else {}
    if hidden_heads is not None:
        builders |= hidden_heads.builders()
    if model is not None:
        builders |= grammar_builders(model)
    return speculator_factory(builders or None)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def free_memory() -> int:
    """Bytes of memory free now (MemAvailable), 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_cache_bytes(config: EngineConfig, free: int) -> int:
    """The prompt cache's host tier budget: config.cache_ram MiB, else a quarter of the `free` bytes, at most
    8 GiB (llama-server's default), as a log line says.

    >>> host_cache_bytes(EngineConfig(cache_ram=0), 2**34), host_cache_bytes(EngineConfig(), 2**32) // 2**20
    (0, 1024)
    """
    mib = config.cache_ram if config.cache_ram is not None else min(8192, free // 4 // 2**20)
    return mib * 2**20 if config.prompt_cache else 0


def _host_tier(config: EngineConfig, memory: TargetMemory) -> int:
    budget = host_cache_bytes(config, free_memory()) if memory.keeps_prefix else 0
    if budget:
        log.info("prompt cache host tier: up to %d MiB of evicted prefixes kept in host memory (cache_ram)",
                 budget // 2**20)
    return budget


def build_engine(config: EngineConfig, *, actors=None, model=None, step_timeout_s: float | None = None,
                 served: bool = False, target_hop: str = "actor", companion_hop: str = "actor") -> EngineParts:
    """Assemble an engine. Without `actors`, everything runs in this process (`model`: an already loaded
    target to reuse). With `actors` (a started actors.launch.Actors), the target and the model speculators
    run in them (they decide their own thread counts where they run). `served`: behind the HTTP pipeline
    (a replica), which decides the default thread count. The cost model is measured at start when
    config.calibrate (where the target decodes). `target_hop`, `companion_hop`: how rounds reach the target
    and the companion actors (ServeConfig.target_hop, companion_hop)."""
    config = config.with_threads(served, usable_cpus())
    if actors is None:
        return _build_local(config, model)
    return _build_remote(config, actors, step_timeout_s, target_hop, companion_hop)


def _build_local(config: EngineConfig, model) -> EngineParts:
    model, ctx = open_target(config, model)
    try:
        runner, memory = target_runner(config, model, ctx)
        cost = DecodeCostModel.calibrated(runner.calibrate_cost()) if config.calibrate else DecodeCostModel()
        draft_model = open_draft(config, model, ctx)
        hidden_heads = open_hidden(config, model, ctx, runner)
    except BaseException:
        ctx.close()
        raise
    factory = local_speculator_factory(draft_model, hidden_heads, model)
    chain = Chain(config.chain, factory)
    parts = EngineParts(config, model, chain, None, ctx.n_ctx, ctx.n_ctx_seq, factory, ctx=ctx, runner=runner,
                        draft_model=draft_model, hidden_heads=hidden_heads)
    try:
        # a sequence may use n_ctx_seq cells; with a unified KV cache all slots share n_ctx
        parts.scheduler = Scheduler(config, runner, model, chain, ctx.n_ctx_seq, cost,
                                    shared_cells=ctx.n_ctx if ctx.kv_unified else None, memory=memory,
                                    constraints=runner.constraints, host_cache_bytes=_host_tier(config, memory))
    except BaseException:  # a setting this target refuses (context_shift on a recurrent model): nothing leaks
        parts.close()
        raise
    if config.overlap:
        # a GPU's llama_decode returns once the graph is queued; the CPU backend's only when done: there the
        # overlapped work goes to a helper thread while the round thread decodes
        parts.scheduler.use_overlap(decode_blocks=model.n_gpu_layers == 0)
    return parts


def _build_remote(config: EngineConfig, actors, step_timeout_s: float | None, target_hop: str,
                  companion_hop: str) -> EngineParts:
    from specray.native.grammar import GrammarCompiler
    from specray.native.model import Model

    from .actors.companion import companion_speculator_factory
    from .actors.target import RemoteTarget
    from .actors.target_channel import companion_has_room, resolve_companion_hop, resolve_target_hop

    info = actors.target.info
    # this process only tokenizes and detokenizes: the vocabulary without weights
    model = Model(config.model, chat_template=config.chat_template, vocab_only=True)
    hop = resolve_target_hop(target_hop, info)
    companion_info = actors.companion.sup.info or {}
    actors.companion.use_hop(resolve_companion_hop(companion_hop, info, companion_info))
    behind = config.hidden.flush_behind
    actors.companion.flush_behind = companion_has_room(info, companion_info) if behind is None else behind
    remote = RemoteTarget(actors.target.handle, epoch=actors.target.epoch, timeout_s=step_timeout_s, hop=hop)
    cost = DecodeCostModel()
    if config.calibrate:
        cost = DecodeCostModel.calibrated(remote.calibrate())
    # model speculators run in the companion actor, one call per round for all slots
    factory = companion_speculator_factory(actors.companion, config, ack_sink=remote.ack_hidden,
                                           extra=grammar_builders(model))
    chain = Chain(config.chain, factory)
    memory = TargetMemory(**info["memory"])
    # (the host tier's bytes live in the target actor: its budget is taken from this node's free memory)
    scheduler = Scheduler(config, remote, model, chain, info["n_ctx_seq"], cost,
                          shared_cells=info["n_ctx"] if info["kv_unified"] else None, memory=memory,
                          constraints=GrammarCompiler.of(model), host_cache_bytes=_host_tier(config, memory))
    if config.overlap:  # the actor call returns at once: the overlapped work runs while the actor decodes
        scheduler.use_overlap(decode_blocks=False)
    return EngineParts(config, model, chain, scheduler, info["n_ctx"], info["n_ctx_seq"], factory, remote=remote,
                       actors=actors)
