"""The co-located engine: target context, round scheduler and speculators in one process.

It backs `specray generate`, `specray bench` and the co-located deployment
mode, and is the baseline every distributed figure is compared with.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.sampling import SamplingParams

from .builder import build_engine

log = logging.getLogger("specray.local")


class LocalEngine:
    """Everything in-process. Thread-safe: one lock around each round."""

    def __init__(self, config: EngineConfig, model=None) -> None:
        self.parts = build_engine(config, model=model)
        self.config = self.parts.config  # with its thread count decided
        p = self.parts
        self.model, self.ctx, self.runner, self.chain, self.scheduler = p.model, p.ctx, p.runner, p.chain, p.scheduler
        self.draft_model, self.hidden_heads = p.draft_model, p.hidden_heads
        self.speculator_factory = p.speculator_factory
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
        cache_prompt: bool = True,
        tree: bool = True,
    ) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=self.prompt_tokens(prompt, messages),
            max_tokens=max_tokens,
            sampling=sampling or SamplingParams(),
            stop=list(stop or []),
            chain=chain,
            n_max=n_max,
            ignore_eos=ignore_eos,
            cache_prompt=cache_prompt,
            tree=tree,
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

    def set_chain(self, chain: ChainConfig) -> dict:
        """Swap the chain (Scheduler.reconfigure_chain: running sequences go on with the new one)."""
        with self.lock:
            result = self.scheduler.reconfigure_chain(chain)
            self.config = self.config.model_copy(update={"chain": chain})
            return result

    def close(self) -> None:
        self.parts.close()
