"""The co-located engine: target context, round scheduler and speculators in one process.

It backs `specray generate`, `specray bench` and the co-located deployment
mode, and is the baseline every distributed figure is compared with.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.sampling import SamplingParams
from specray.engine.scheduler import Scheduler
from specray.engine.speculators.registry import Factory, speculator_factory
from specray.engine.target import TargetRunner
from specray.native.context import Context
from specray.native.model import Model

log = logging.getLogger("specray.local")


def exact_bufts(config: EngineConfig) -> bool | None:
    """Weight repacking: off in exact mode (repacked K-quant kernels switch paths by batch size)."""
    if config.exact:
        if config.use_extra_bufts:
            raise ValueError("exact mode needs use_extra_bufts off (repacked kernels are not batch-invariant)")
        return False
    return config.use_extra_bufts


def open_target(config: EngineConfig, model: Model | None = None) -> tuple[Model, Context]:
    model = model or Model(
        config.model,
        n_gpu_layers=config.n_gpu_layers,
        use_extra_bufts=exact_bufts(config),
        chat_template=config.chat_template,
        load_mtp=config.hidden.mtp,  # a co-located MTP head shares these weights
    )
    ctx = Context(
        model,
        n_ctx=config.n_ctx,
        n_seq_max=config.slots,
        n_batch=config.n_batch,
        n_threads=config.threads,
        flash_attn=config.flash_attn and not config.exact,
        exact=config.exact,
    )
    return model, ctx


def open_draft(config: EngineConfig, target: Model, target_ctx: Context):
    """The draft model of the `draft` speculator (None if none is configured). Checks the vocabularies:
    an incompatible pair raises VocabMismatchError unless config.draft.cross_vocab."""
    if not config.draft.model:
        return None
    from specray.native.draft_backend import DraftModel

    return DraftModel(config.draft, target, slots=config.slots, target_n_ctx=target_ctx.n_ctx,
                      n_batch=config.n_batch, threads=config.threads, calibrate=config.calibrate)


def open_hidden(config: EngineConfig, target: Model, target_ctx: Context, runner: TargetRunner | None = None):
    """The heads of the hidden-state speculators (mtp, eagle3; None if none is configured), in-process; with
    `runner`, its target context is given the hidden-row taps they read (switched on only when needed)."""
    if not config.hidden.enabled:
        return None
    from specray.native.hidden import HiddenOutput
    from specray.native.hidden_heads import open_hidden_heads

    heads = open_hidden_heads(config, target, target_n_ctx=target_ctx.n_ctx, target_model=target)
    if runner is not None:
        runner.hidden_out = HiddenOutput(target_ctx, heads.taps)
    return heads


def local_speculator_factory(draft_model, hidden_heads=None) -> Factory:
    """Chain factory of the co-located engine: model speculators run in-process on `draft_model` and the
    hidden-state heads (their rows come from the target in-process, without a copy)."""
    builders = {"draft": draft_model.speculator} if draft_model is not None else {}
    if hidden_heads is not None:
        builders |= hidden_heads.builders()
    return speculator_factory(builders or None)


class LocalEngine:
    """Everything in-process. Thread-safe: one lock around each round."""

    def __init__(self, config: EngineConfig, model: Model | None = None) -> None:
        self.config = config
        self.model, self.ctx = open_target(config, model)
        self.runner = TargetRunner(self.ctx, record_margins=config.record_margins)
        cost = DecodeCostModel()
        if config.calibrate:
            cost = DecodeCostModel.calibrated(self.runner.calibrate_cost())
        self.draft_model = open_draft(config, self.model, self.ctx)
        self.hidden_heads = open_hidden(config, self.model, self.ctx, self.runner)
        self.speculator_factory = local_speculator_factory(self.draft_model, self.hidden_heads)
        self.chain = Chain(config.chain, self.speculator_factory)
        self.scheduler = Scheduler(
            config, self.runner, self.model, self.chain, self.ctx.n_ctx_seq, cost,
            shared_cells=self.ctx.n_ctx if self.ctx.kv_unified else None,
        )
        self.lock = threading.RLock()

    # ---- request helpers -------------------------------------------------------------
    def prompt_tokens(self, prompt: str | None = None, messages: list[dict] | None = None) -> np.ndarray:
        if messages is not None:
            return self.model.chat_tokens(messages)
        if prompt is None or prompt == "":
            raise ValueError("prompt is empty")
        return self.model.tokenize(prompt, add_special=True, parse_special=True)

    def request(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        *,
        max_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: list[str] | None = None,
        chain: tuple[str, ...] | None = None,
        n_max: int | None = None,
        ignore_eos: bool = False,
    ) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=self.prompt_tokens(prompt, messages),
            max_tokens=max_tokens,
            sampling=sampling or SamplingParams(),
            stop=list(stop or []),
            chain=chain,
            n_max=n_max,
            ignore_eos=ignore_eos,
        )

    def submit(self, req: GenerationRequest) -> Sequence:
        with self.lock:
            return self.scheduler.submit(req)

    def step(self):
        with self.lock:
            return self.scheduler.step()

    def run(self, reqs: list[GenerationRequest]) -> list[Sequence]:
        with self.lock:
            return self.scheduler.run(reqs)

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, **kw) -> Sequence:
        return self.run([self.request(prompt, messages, **kw)])[0]

    def set_chain(self, chain: ChainConfig) -> None:
        """Swap the chain (new speculator instances); only between requests."""
        with self.lock:
            if self.scheduler.has_work():
                raise RuntimeError("cannot change the chain while requests are running")
            self.config = self.config.model_copy(update={"chain": chain})
            self.chain = Chain(chain, self.speculator_factory)
            self.scheduler.chain = self.chain
            self.scheduler.config = self.config

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
        if self.hidden_heads is not None:
            self.hidden_heads.close()
        self.ctx.close()
