"""Typed configs of the engine: the speculator chain and the engine itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .speculators.registry import config_fields, model_speculators
from .verify_shape import DEFAULT_BUCKETS

Policy = Literal["first", "expected", "cost"]


class ChainConfig(BaseModel):
    """A chain of speculators and how one draft per sequence is chosen from them."""

    model_config = ConfigDict(extra="forbid")

    speculators: list[str] = Field(
        default_factory=lambda: ["ngram_mod", "suffix", "ngram_cache", "grammar"],
        description="speculator names in priority order; empty = no speculation. The default is the three "
        "model-free n-gram speculators, which draft from text already in the context at no model cost, then "
        "`grammar`, which drafts only for requests with a grammar (structured outputs). Choosing another chain: "
        "docs/speculators.md",
    )
    params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-speculator parameters, by speculator name"
    )
    policy: Policy = Field(
        "cost",
        description="first: the first non-empty draft wins (llama.cpp's rule); expected: the highest acceptance "
        "rate x draft length; cost: the highest expected accepted tokens, cut to the length that maximises expected "
        "tokens per second under the verify cost calibrated at start-up. The cost policy sends a draft only where "
        "its price model expects a gain; where that model is wrong it can lose to plain decoding (known on GPUs "
        "and with flash attention on CPU: docs/benchmarks.md)",
    )
    n_max: int = Field(
        64, ge=0, le=256,
        description="cap on draft tokens per sequence per round (the cost policy cuts each draft to what pays; "
        "the default leaves room for the long copies where n-gram drafts gain most)",
    )
    explore: float = Field(
        0.0, ge=0.0, le=1.0,
        description="cost policy: share of rounds in which a free speculator's draft the planner would drop is "
        "still sent with one token (at most about explore x one verify row of extra work). Off by default: every "
        "draft, sent or not, is judged against the tokens the target emits, which teaches its first position as "
        "well as a 1-token send would, so the sends cost throughput for little to learn",
    )
    model_explore: float = Field(
        0.01, ge=0.0, le=1.0,
        description="cost policy: share of round time a model speculator (draft, mtp, eagle3, dflash) may spend on "
        "1-token drafts its price rules out, catch-up of its draft cache included, so its acceptance keeps "
        "being measured; the time is saved up round by round, then spent",
    )

    trees: bool = Field(
        False, description="send draft trees where they pay: the main draft plus runner-up branches its "
        "speculator holds (suffix, ngram_map_k4v, ngram_cache, draft), verified in one decode (the cost policy "
        "only; the engine's tree_branches sizes them). Off by default (docs/benchmarks.md says why)")
    tune: bool = Field(
        False,
        description="tune each model-free speculator's look-up parameters online (engine/policy/tuning.py): a "
        "bandit per speculator and sequence class over a small grid (suffix min_match/p_min, ngram_mod n_min, "
        "ngram_cache n_draft, ngram_simple size_n/size_m); every setting is judged side by side on shadow look-ups by the tokens "
        "its drafts would gain net of their verify and look-up time; starts from `params`. /v1/stats `tuning` shows "
        "the current choice",
    )
    tune_explore: float = Field(
        0.02, ge=0.0, le=1.0,
        description="tuning: share of the rounds' plain decode time a speculator's shadow look-ups may take (every "
        "setting drafting for one sequence, judged later against what the target emitted; "
        "engine/policy/tuning_shadow.py), saved up round by round, after a start-up allowance of 16 shadows per "
        "speculator and class",
    )
    tune_grids: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict,
        description="tuning: the grid per speculator (each point: parameters set over `params`); speculators not "
        "named use the built-in grid (engine/policy/tuning.py DEFAULT_GRIDS); an empty list turns tuning off for "
        "one",
    )

    @field_validator("speculators", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return parse_chain(v)
        return v

    @property
    def enabled(self) -> bool:
        return bool(self.speculators) and self.n_max > 0

    @property
    def label(self) -> str:
        return ",".join(self.speculators) or "none"


def parse_chain(text: str) -> list[str]:
    """'ngram_mod,suffix' -> ['ngram_mod', 'suffix']; 'none' or '' -> []."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        return []
    if "none" in names:
        raise ValueError(f"'none' cannot be combined with other speculators in chain {text!r}")
    return names


#: KV cache types llama.cpp takes for -ctk/-ctv (common/arg.cpp's kv_cache_types); the q* and iq* ones are quantised
CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
QUANTISED_CACHE_TYPES = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})


#: DraftModelConfig's load options, each a `--draft-<option>` flag (dest draft_<field>) of generate, bench, serve
DRAFT_LOAD_FIELDS = ("n_ctx", "threads", "threads_batch", "n_batch", "n_ubatch", "n_gpu_layers", "main_gpu",
                     "cache_type_k", "cache_type_v", "flash_attn")


# `model`, the field that enables the `draft` speculator, is declared by its registry entry (config_fields)
class DraftModelConfig(config_fields("draft")):
    """The draft model of the `draft` speculator (loaded only when `model` is set). The load options follow
    llama.cpp's draft flags (-cd, -td, -tbd, -ngld, -devd, -ctkd, -ctvd); each left unset follows the target."""

    model_config = ConfigDict(extra="forbid")

    cross_vocab: bool = Field(
        False,
        description="allow a draft model whose vocabulary is not compatible with the target's (llama.cpp's rules): "
        "drafts then go through text; without it such a pair is refused with the rule it breaks",
    )
    n_ctx: int | None = Field(
        None, ge=64, description="draft context cells shared by all slots (None: the target's n_ctx, x1.5 in "
        "cross-vocab mode, + 16 per slot)"
    )
    threads: int | None = Field(None, ge=1, description="CPU threads of the draft context (None: the engine's)")
    threads_batch: int | None = Field(
        None, ge=1, description="CPU threads of the draft context for batches of several tokens (the mirrored "
        "prompt chunks and catch-ups; llama.cpp's -tbd); None: `threads`")
    n_batch: int | None = Field(
        None, ge=16, description="most tokens in one draft decode; longer mirrored batches are split (None: the "
        "engine's n_batch)")
    n_ubatch: int | None = Field(
        None, ge=16, description="physical batch of the draft context, at most n_batch (None: its n_batch)")
    n_gpu_layers: int | None = Field(
        None, ge=0, description="draft layers offloaded to a GPU (llama.cpp's -ngld); None: all of them where "
        "this llama.cpp build offloads to a GPU it sees, none elsewhere (the target's default rule)")
    main_gpu: int | None = Field(
        None, ge=0, description="the one GPU that holds the whole draft model (index among the GPUs its process "
        "sees: in distributed mode the companion actor's; llama.cpp's -devd with one device); None: the target's "
        "main_gpu and split_mode (row and tensor splits become layer splits: a draft is small)")
    cache_type_k: CacheType = Field(
        "f16", description="data type of the draft context's K cache (llama.cpp's -ctkd); quantised types "
        "(q8_0, q4_0, ...) take less memory, and the draft only proposes: output stays lossless")
    cache_type_v: CacheType = Field(
        "f16", description="data type of the draft context's V cache (llama.cpp's -ctvd); a quantised one needs "
        "flash attention, which it turns on for the draft context unless flash_attn is false (refused)")
    flash_attn: bool | None = Field(
        None, description="flash attention in the draft context; None: the engine's flash_attn, on with a "
        "quantised cache_type_v (as llama.cpp's auto does)")

    @classmethod
    def from_flags(cls, args: Any) -> "DraftModelConfig":
        """The draft config of a command line (an argparse namespace): --draft-model, --cross-vocab and the
        --draft-<option> flags of DRAFT_LOAD_FIELDS; a flag absent or None leaves its default."""
        dests = {"model": "draft_model", "cross_vocab": "cross_vocab"} | {f: f"draft_{f}" for f in DRAFT_LOAD_FIELDS}
        given = {f: getattr(args, d, None) for f, d in dests.items()}
        return cls.model_validate({f: v for f, v in given.items() if v is not None})

    @model_validator(mode="after")
    def _llama_rules(self) -> "DraftModelConfig":
        # llama.cpp refuses these when the context is made; saying so here names the options before anything loads
        if self.cache_type_v in QUANTISED_CACHE_TYPES and self.flash_attn is False:
            raise ValueError(f"cache_type_v {self.cache_type_v} (a quantised V cache) needs flash attention in "
                             "llama.cpp: leave flash_attn unset or set it true, or use an f16/bf16/f32 cache_type_v")
        if self.n_ubatch is not None and self.n_batch is not None and self.n_ubatch > self.n_batch:
            raise ValueError(f"n_ubatch ({self.n_ubatch}) exceeds n_batch ({self.n_batch})")
        return self

    def context_flash_attn(self, engine_flash_attn: bool) -> bool:
        """Flash attention of the draft context: as set; else on for a quantised V cache, else the engine's.

        >>> plain, q8_v = DraftModelConfig(), DraftModelConfig(cache_type_v="q8_0")
        >>> plain.context_flash_attn(False), q8_v.context_flash_attn(False), plain.context_flash_attn(True)
        (False, True, True)
        """
        if self.flash_attn is not None:
            return self.flash_attn
        return engine_flash_attn or self.cache_type_v in QUANTISED_CACHE_TYPES


HiddenTransportName = Literal["object_store", "inline", "cuda_ipc"]


# the field that enables each hidden-state speculator (`eagle3_model`, ...) is declared by its registry entry
# (config_fields) and comes first, in registry order; the fields below are shared by all
class HiddenStateConfig(config_fields("hidden")):
    """Hidden-state speculators (the ones that read the target's hidden rows): the field that enables each, their
    heads and how the target's hidden rows reach them."""

    model_config = ConfigDict(extra="forbid")

    transport: HiddenTransportName = Field(
        "object_store",
        description="distributed mode: how hidden rows go from the target actor to the companion: object_store "
        "(the target ray.put()s each round's rows, the reference goes to the companion, the router never copies "
        "them), cuda_ipc (a CUDA IPC handle of a device buffer, same node, GPUs only: without CUDA it falls back "
        "to object_store and says why in the actors' info), inline (by value inside the step result and the "
        "companion call: two copies through the router, a baseline); co-located mode always passes them "
        "in-process without a copy")
    inline_below_bytes: int = Field(
        96 * 1024, ge=0, description="object_store / cuda_ipc: a round's rows smaller than this go by value "
        "instead (a ray.put has a fixed cost however small the record, and Ray passes results and arguments "
        "under 100 KiB by value itself; 0: never)")
    flush_behind: bool | None = Field(
        None, description="distributed mode: the router's flush of buffered rows (every 16 records without a draft "
        "request) goes without waiting for the companion, which replays them while the target decodes; None: on where "
        "the node has a core beyond the target's and the companion's threads, or the target decodes on a GPU "
        "(without a spare core the replay competes with the decode for it)")
    n_ctx: int | None = Field(
        None, ge=64, description="head context cells shared by all slots (None: the target's n_ctx + 16 per slot)")
    threads: int | None = Field(None, ge=1, description="CPU threads of the head contexts (None: the engine's)")

    @property
    def enabled(self) -> bool:
        """Whether any hidden-state speculator is configured (engine/speculators/registry.SPECULATORS)."""
        return any(bool(getattr(self, s.config_field[1])) for s in model_speculators(hidden_rows=True))


@dataclass(frozen=True)
class DraftSettings:
    """How the draft model and its context are loaded: DraftModelConfig with every unset option decided from the
    engine's config (EngineConfig.draft_settings). n_gpu_layers None: llama.cpp's all-or-none rule
    (native/lib.resolve_gpu_layers)."""

    threads: int
    threads_batch: int
    n_batch: int
    n_ubatch: int
    n_gpu_layers: int | None
    main_gpu: int
    split_mode: str
    cache_type_k: str
    cache_type_v: str
    flash_attn: bool


#: target threads of an in-process engine (generate, bench) unless set
IN_PROCESS_THREADS = 2


def served_threads(n_cpus: int) -> int:
    """Target threads of a served engine on a host with n_cpus usable CPUs: all of them, as in process: leaving
    a core to the request pipeline does not speed the served engine up (docs/serving.md).

    >>> [served_threads(n) for n in (1, 2, 4, 16)]
    [1, 2, 4, 16]
    """
    return max(1, n_cpus)


class EngineConfig(BaseModel):
    """Everything the in-process engine (target context + round scheduler) needs."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2-135m", description="packaged alias (smollm2-135m, gemma3-270m) or .gguf path")
    chat_template: str | None = Field(
        None, description="chat template name or Jinja text for models whose GGUF has none (e.g. 'gemma')"
    )
    n_ctx: int = Field(4096, ge=64, description="context cells shared by all slots (unified KV cache)")
    slots: int = Field(4, ge=1, le=256, description="sequences decoded concurrently (n_seq_max)")
    n_batch: int = Field(512, ge=16, description="max tokens in one target decode (prefill chunks + verify rows)")
    tree_branches: int = Field(
        3, ge=0, le=15, description="runner-up branches a sequence's draft may carry beside it: a draft tree, "
        "verified in the same decode, each branch a sequence id of its own (the target context gets slots x "
        "(1 + tree_branches) of them, at most 256). The cost policy sends a branch only where its expected tokens "
        "pay for its rows, with chain.trees on. Trees need one KV pool (not exact mode), an attention target, "
        "verify_shape exact and a speculator with runner-ups (suffix, ngram_map_k4v, ngram_cache, draft); "
        "elsewhere drafts stay linear. 0: linear drafts only, and no spare sequence ids")
    threads: int | None = Field(
        None, ge=1, description="CPU threads for the target context. None: 2 in process (generate, bench); served, "
        "the CPUs the serving process may use (served_threads). With several replicas on one node, set it so they "
        "add up to the cores")
    n_gpu_layers: int | None = Field(
        None, ge=0, description="target layers offloaded to a GPU; None (the default): all of them where this "
        "llama.cpp build offloads to a GPU it sees (a CUDA build with a device), none elsewhere")
    main_gpu: int = Field(0, ge=0, description="the GPU (index among those the process sees) that holds the whole "
                          "model with split_mode none, and the intermediate results with split_mode row")
    split_mode: Literal["none", "layer", "row", "tensor"] = Field(
        "layer", description="how a target spreads over several GPUs (llama.cpp's split_mode): layer (whole layers "
        "per GPU, by tensor_split), row (each weight matrix split by rows), tensor (llama.cpp's tensor parallelism) "
        "or none (main_gpu only). A target actor spread over GPUs asks Ray for them: target_gpus")
    tensor_split: tuple[float, ...] | None = Field(
        None, description="share of the model per visible GPU, e.g. (3, 1): three quarters on the first; None: "
        "by free memory (llama.cpp's default)")
    flash_attn: bool | None = Field(
        None, description="flash attention in the target context; None (the default): on, except in exact mode "
        "(its batch-invariant kernels need it off), as llama-server's --flash-attn auto on a CPU. Without it every "
        "row attends to every slot's KV cells, masked or not, so it gains most with several slots; long verify "
        "batches of one sequence cost more with it. With several slots a token's logits then depend on where the "
        "other sequences' KV cells lie (the bench's tie bound measures it)")
    exact: bool = Field(
        False,
        description="batch-invariant target: llamafile sgemm, tiled K-quant matmuls, weight repacking and "
        "flash attention off, one KV stream per slot, so a token's logits "
        "do not depend on what else shares its batch; greedy output is then token-identical to plain decoding",
    )
    use_extra_bufts: bool | None = Field(
        None, description="weight repacking buffers; None = on unless the build has AMX kernels (they "
        "crash at the first decode: docs/troubleshooting.md) or exact mode is on (repacked K-quant kernels are not "
        "batch-invariant)"
    )
    prompt_cache: bool = Field(
        True, description="keep a finished sequence's KV in its slot; a new prompt sharing a prefix with it (the "
        "next turn of a chat) reuses those cells and prefills only the rest. Requests can opt out with "
        "`cache_prompt: false`. Output is the same either way (exact mode: token-identical)")
    prompt_cache_slowdown: float = Field(
        0.1, ge=0.0, description="with one KV pool for all slots and flash attention off, llama.cpp computes "
        "every cell in use for each token, so idle slots' cached cells slow the running sequences down: the idle "
        "cells kept cost at most this share of a one-row decode (priced by the calibrated attention cost per "
        "cell); the least recently used are evicted beyond it. No limit with flash attention or exact mode")
    context_shift: bool = Field(
        False, description="when a generating sequence reaches its context, discard old cells and go on (llama-server's "
        "--context-shift): the first n_keep tokens stay, n_discard after them go, the later cells move back. Off: a "
        "request must fit its context (prompt + max_tokens), as before. Requests may set it themselves "
        "(`context_shift`). Refused on targets whose memory cannot shift positions (recurrent, hybrid)")
    n_keep: int = Field(
        0, ge=-1, description="context shift: tokens kept at the front of the context (+ BOS where the prompt starts "
        "with it), as llama-server's n_keep; -1: the whole prompt. Requests may set `n_keep`")
    n_discard: int | None = Field(
        None, ge=1, description="context shift: tokens discarded after the kept ones at each shift; None: half of "
        "what lies past them (llama-server's default). Requests may set `n_discard`")
    prefill_chunk: int = Field(256, ge=16, description="prompt tokens prefilled per round per sequence")
    prefill_budget: int | None = Field(
        None, ge=16, description="prompt tokens one round carries in all while other sequences decode, so their "
        "streams keep a steady pace during long prefills (vLLM's chunked-prefill token budget); short prompts "
        "and continuations go first. None: as many as n_batch has room for")
    cache_ram: int | None = Field(
        None, ge=0, description="MiB of host memory for the prompt cache's host tier (llama-server's "
        "--cache-ram): evicted prefixes are saved there and restored when a later prompt shares them. 0: off; "
        "None: a quarter of the memory free at start, at most 8192")
    max_queue: int = Field(256, ge=0, description="requests waiting for a slot before new ones are refused")
    queue_order: Literal["cached", "arrival"] = Field(
        "cached", description="the order waiting requests get free slots in when more wait than slots are free. "
        "cached: fewest prompt tokens left after the longest cached prefix first (a conversation's next turn "
        "before a new conversation, as SGLang's longest-prefix-match order), bounded by queue_max_wait_s; "
        "arrival: first come, first served")
    queue_max_wait_s: float = Field(
        20.0, gt=0, description="with queue_order cached: a request that has waited this long goes ahead of any "
        "that has not, in arrival order, so none waits forever behind shorter prompts")
    overlap: bool = Field(
        False, description="overlapped rounds: the host work of a round that needs no result of it (the last "
        "round's text decoded, its events made and delivered; model-free speculators' set-up of new sequences "
        "and merge of finished ones; the policy's learning from the last round's verdicts, its stats and "
        "prices) runs while the target decodes. A GPU's decode "
        "returns once queued, so that work is hidden behind the device's; on CPU the decode runs on a thread of "
        "its own, which exercises the overlap but gains little (the decode's threads hold the cores). With a "
        "target actor (distributed mode) the work runs while the actor decodes")
    tile_pads: bool = Field(
        True, description="pad a round of fewer rows than the CPU flash-attention kernel's tile (64) up to it "
        "where the cost model prices the padded round cheaper: from the tile on, llama.cpp runs attention as a "
        "GEMM per tile, several times cheaper per row and cached token, so an agent's next turn (a few dozen new "
        "prompt rows after a long cached history) gets its first token sooner. The pad rows give no output and "
        "their cells are dropped after the decode. Applies to fast mode with flash attention on the CPU, one KV "
        "pool and F16/F32 caches")
    chain: ChainConfig = Field(default_factory=ChainConfig, description="the speculator chain")
    draft: DraftModelConfig = Field(
        default_factory=DraftModelConfig, description="draft model for the `draft` speculator (in-process when "
        "co-located, in the companion actor when distributed)"
    )
    hidden: HiddenStateConfig = Field(
        default_factory=HiddenStateConfig, description="hidden-state speculators mtp / eagle3 / dflash (in-process when "
        "co-located, in the companion actor when distributed)")
    verify_shape: Literal["exact", "bucketed"] = Field(
        "exact", description="the target batch's shape in decode-only rounds. exact: each sequence's verify is "
        "its last token + its draft, as long as that is. bucketed: every decoding sequence's verify is padded, with "
        "rows that are then rejected, to the same bucket of verify_buckets (the smallest holding the round's longest "
        "verify; drafts are cut to the largest bucket - 1), so the batch takes a few shapes and a GPU backend can "
        "replay its captured graphs (engine/verify_shape.py). Lossless either way; the cost policy prices the padded "
        "shape. Off by default: on CPU a padded row costs nearly a real one (docs/serving.md)")
    verify_buckets: tuple[int, ...] = Field(
        DEFAULT_BUCKETS, description="verify_shape=bucketed: rows per decoding sequence a decode-only round may "
        "take (1 = a plain decode; without 1, rounds without drafts are padded too)")
    rollback: Literal["auto", "snapshots", "checkpoint", "off"] = Field(
        "auto", description="how a recurrent or hybrid target (Mamba, RWKV, LFM2, Qwen3-Next, Jamba, ...) takes a "
        "rejected draft back out of its state (engine/rollback.py); attention-only targets ignore it. snapshots: "
        "llama.cpp keeps each sequence's state after each of its last rollback_snapshots tokens and rolls back to "
        "one (some architectures only, at most 2 slots; drafts capped at that many tokens). checkpoint: the state is "
        "saved before a verify that carries drafts, restored after a partial rejection, and the accepted tokens "
        "replayed in the next round's batch. auto: checkpoint (it works at any slot count). "
        "off: no drafts on such targets. Either way such targets run without the prompt cache and with "
        "verify_shape exact")
    rollback_snapshots: int = Field(
        8, ge=1, le=64, description="rollback snapshots: recurrent states kept per sequence (llama.cpp's n_rs_seq), "
        "the most draft tokens one verify may carry; each costs one more copy of the recurrent state in memory")
    calibrate: bool = Field(True, description="measure verify cost by batch size at start (cost policy)")
    record_margins: bool = Field(False, description="record top-2 logit margins of emitted tokens (bench)")

    def with_threads(self, served: bool, n_cpus: int) -> "EngineConfig":
        """This config with `threads` decided (None -> the default for where it runs); as is when set."""
        if self.threads is not None:
            return self
        return self.model_copy(update={"threads": served_threads(n_cpus) if served else IN_PROCESS_THREADS})

    def draft_settings(self) -> DraftSettings:
        """The draft model's load and context settings: its own where set, else the target's (llama.cpp's draft
        copies the target's parameters the same way). A draft pinned to one GPU (draft.main_gpu) loads whole
        onto it; otherwise it takes the target's main_gpu and, for a small model, whole layers per GPU."""
        d = self.draft
        threads = d.threads or self.threads or IN_PROCESS_THREADS
        n_batch = d.n_batch or self.n_batch
        pinned = d.main_gpu is not None
        return DraftSettings(
            threads=threads, threads_batch=d.threads_batch or threads, n_batch=n_batch,
            n_ubatch=d.n_ubatch or n_batch, n_gpu_layers=d.n_gpu_layers,
            main_gpu=d.main_gpu if pinned else self.main_gpu,
            split_mode="none" if pinned or self.split_mode == "none" else "layer",
            cache_type_k=d.cache_type_k, cache_type_v=d.cache_type_v, flash_attn=d.context_flash_attn(self.flash_attn_on))

    @field_validator("tensor_split", mode="after")
    @classmethod
    def _tensor_split(cls, v: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if v is not None and (not v or min(v) < 0 or sum(v) <= 0 or len(v) > 16):
            raise ValueError(f"tensor_split must be 1-16 shares >= 0 with a positive sum, got {v}")
        return v

    @field_validator("verify_buckets", mode="after")
    @classmethod
    def _buckets(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or min(v) < 1:
            raise ValueError(f"verify_buckets must be one or more row counts >= 1, got {v}")
        return tuple(sorted(set(v)))

    @property
    def shape_buckets(self) -> tuple[int, ...] | None:
        """The buckets decode-only rounds are padded to, or None (verify_shape exact)."""
        return self.verify_buckets if self.verify_shape == "bucketed" else None

    @model_validator(mode="after")
    def _exact_rules(self) -> "EngineConfig":
        # the one place these rules live: every mode builds its engine from this config (deployments/builder.py)
        if self.exact and self.flash_attn:
            raise ValueError("flash_attn conflicts with exact (batch-invariant kernels need flash attention off)")
        if self.exact and self.use_extra_bufts:
            raise ValueError("use_extra_bufts conflicts with exact (repacked kernels are not batch-invariant)")
        if self.draft.n_batch is None and (self.draft.n_ubatch or 0) > self.n_batch:
            raise ValueError(f"draft.n_ubatch ({self.draft.n_ubatch}) exceeds the draft's n_batch, the engine's "
                             f"n_batch ({self.n_batch}) when draft.n_batch is unset")
        if self.verify_shape == "bucketed" and max(self.verify_buckets) > self.n_batch:
            raise ValueError(f"verify_buckets' largest bucket ({max(self.verify_buckets)} rows) exceeds n_batch "
                             f"({self.n_batch})")
        return self

    @property
    def flash_attn_on(self) -> bool:
        """flash_attn as decided: the explicit setting, else on unless exact mode (which needs it off).

        >>> EngineConfig().flash_attn_on, EngineConfig(exact=True).flash_attn_on, EngineConfig(flash_attn=False).flash_attn_on
        (True, False, False)
        """
        return (not self.exact) if self.flash_attn is None else self.flash_attn

    @property
    def repack_weights(self) -> bool | None:
        """Weight repacking as the model is loaded: off in exact mode (repacked K-quant kernels switch paths by
        batch size); None leaves it to the build (on, unless its AMX kernels would crash: native/model.py)."""
        return False if self.exact else self.use_extra_bufts
