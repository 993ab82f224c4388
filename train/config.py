"""What `specray train-head` does, as one typed config (the CLI fills it from its flags)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HeadShape(BaseModel):
    """The head's shape. Width, heads and FFN default to the target's (0 = the target's), so its token
    embeddings, LM head, norms and decoder layer can start from the target's own weights."""

    model_config = ConfigDict(extra="forbid")

    n_embd: int = Field(0, ge=0, description="head width (0: the target's n_embd)")
    n_head: int = Field(0, ge=0, description="attention heads (0: the target's)")
    n_head_kv: int = Field(0, ge=0, description="KV heads (0: the target's)")
    n_ff: int = Field(0, ge=0, description="FFN width (0: the target's)")
    target_layers: tuple[int, int, int] | None = Field(
        None, description="the three target layers whose inputs the head reads (None: llama.cpp's default "
        "[2, n/2, n-3], on SmolLM2 2, 15, 27)")
    draft_vocab: int = Field(8192, ge=0, description="LM-head rows: the most frequent target tokens of the generated "
                             "data, mapped back by `d2t` (0: the whole target vocabulary, no d2t)")


class GenConfig(BaseModel):
    """Self-distillation data: the target answers the training prompts through specray's engine."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(256, ge=1, description="tokens per answer at most")
    sampled: int = Field(1, ge=0, description="sampled answers per prompt, besides the greedy one")
    temperature: float = Field(0.8, gt=0, description="temperature of the sampled answers")
    slots: int = Field(8, ge=1, description="sequences the engine generates at once")
    self_prompts: int = Field(0, ge=0, description="user messages the target writes itself before answering "
                              "(train/self_prompts.py: chat prompts with no data set), answered like the file's")
    minutes: float | None = Field(None, gt=0, description="stop generating after this long (None: every answer)")
    max_prompt: int | None = Field(384, ge=1, description="skip prompts longer than this many tokens (None: keep "
                                   "all): a long prompt costs its tokens twice for one answer")
    learn_prompts: bool = Field(False, description="the head also learns on the prompts' positions (the "
                                "target's top token after each prompt token), and a prompt over max_prompt is kept "
                                "without an answer: more data per minute, text the target did not write")
    soft_labels: int = Field(0, ge=0, le=64, description="besides the target's top token, keep its K likeliest "
                             "tokens and their probabilities at each position, for optim.labels 'soft' (0: the top "
                             "token only)")
    text: list[str] = Field(default_factory=list, description="plain-text files (globs) cut into max_len-token "
                            "pieces the head learns on with no answer (needs learn_prompts): prefilled, not "
                            "generated, so many more positions a minute than answers make")
    rows_minutes: float | None = Field(None, gt=0, description="minutes of the generating budget spent first on "
                                       "text with no answer (the --text pieces, and with learn_prompts the prompts "
                                       "too long to answer); None: that text only after the answers, with what is "
                                       "left of the budget")
    max_len: int = Field(1024, ge=16, description="tokens per training sequence at most: longer prompts lose their "
                         "beginning (the rows were computed on the whole prompt)")


class OptimConfig(BaseModel):
    """The optimiser and the rollout."""

    model_config = ConfigDict(extra="forbid")

    epochs: float = Field(8.0, gt=0, description="passes over the training data at most")
    minutes: float | None = Field(None, gt=0, description="training time budget; the learning rate decays to it")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    lm_head_lr_scale: float = Field(
        0.1, gt=0, le=1, description="the LM head's learning rate, as a share of lr: it starts as the target's "
        "own output rows, and Adam moves every row at the full rate, rare tokens' too (their small, steady "
        "gradients push them away from every row h), which would unlearn what held-out text needs")
    warmup: int = Field(20, ge=0, description="linear warm-up steps")
    batch_tokens: int = Field(4096, ge=16, description="tokens per batch (sequences padded to the batch's longest)")
    ttt_steps: int = Field(3, ge=1, le=8, description="rollout steps (EAGLE-3's training-time test): the head "
                           "feeds its own output rows back, as when it drafts")
    step_decay: float = Field(0.8, gt=0, le=1, description="loss weight of rollout step k is step_decay^(k-1)")
    val_fraction: float = Field(0.05, ge=0, lt=0.5, description="prompts held out for the curve's validation, "
                                "with all their answers (a greedy and a sampled answer to one prompt share most "
                                "of their text: split by answer, validation would score text it trained on)")
    eval_every: int = Field(25, ge=1, description="optimiser steps between validation points")
    checkpoint_every: float = Field(120.0, gt=0, description="seconds between checkpoints")
    labels: str = Field("soft", pattern="^(soft|top)$",
                        description="soft: learn the target's distribution over its gen.soft_labels likeliest tokens "
                        "where the data holds them (cross-entropy against those probabilities, renormalised on the "
                        "draft vocabulary; data written with gen.soft_labels 0 has none: its top token then); top: "
                        "its top token only")
    init: str = Field("target", pattern="^(target|random)$",
                      description="target: the LM head's rows and the output norm from the target's weights "
                      "(train/init.py); random: random weights (for comparison)")
    threads: int | None = Field(None, ge=1, description="torch threads (None: torch's default)")


class TrainConfig(BaseModel):
    """`specray train-head`."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field("smollm2-135m", description="target model: packaged alias or .gguf path")
    prompts: str = Field(..., description="JSONL prompts: 'prompt', 'messages' or Spec-Bench 'turns'; "
                         "optional 'category'")
    categories: list[str] | None = Field(None, description="train on these categories only (None: all)")
    exclude_categories: list[str] = Field(default_factory=list, description="never train on these categories")
    skip_first: int = Field(0, ge=0, description="leave out the first N prompts of every category (what `specray "
                            "bench --per-category N` measures on)")
    limit: int | None = Field(None, ge=1, description="use at most this many prompts (after the category filter)")
    out: str = Field(..., description="the head's GGUF (eagle3 layout)")
    work_dir: str = Field(..., description="data shards, vocabulary and checkpoints; a second run resumes from it")
    curve_png: str | None = Field(None, description="draw the learning curve to this PNG")
    weight_type: str = Field("q8_0", pattern="^(q8_0|f16|f32)$",
                             description="the GGUF's matrices (fc stays f16 with q8_0: train/gguf_io.py)")
    seed: int = Field(0, description="prompt order, sampling, initialisation and batch order")
    shape: HeadShape = Field(default_factory=HeadShape)
    gen: GenConfig = Field(default_factory=GenConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    threads: int = Field(2, ge=1, description="llama.cpp threads (data generation)")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        both = set(self.categories or ()) & set(self.exclude_categories)
        if both:
            raise ValueError(f"categories both included and excluded: {', '.join(sorted(both))}")
        if self.gen.text and not self.gen.learn_prompts:
            raise ValueError("--text needs --learn-prompts (text with no answer counts only where prompt positions "
                             "do)")
        return self
