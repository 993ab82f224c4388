"""A loaded GGUF model: weights, vocabulary, tokenizer and chat template."""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import llama_cpp
import numpy as np

from . import lib
from .chat_template import compile_template, is_jinja, message_text, render_chat, tool_messages
from .models import default_template_for, resolve_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VocabInfo:
    """What the vocabulary-compatibility rules of llama.cpp compare."""

    vocab_type: int
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool


SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
               "row": llama_cpp.LLAMA_SPLIT_MODE_ROW, "tensor": llama_cpp.LLAMA_SPLIT_MODE_TENSOR}


def memory_kind(recurrent: bool, hybrid: bool) -> str:
    """'attention' (a KV cache: any suffix can be dropped), 'recurrent' (Mamba, RWKV: one state per sequence,
    no going back) or 'hybrid' (attention layers plus recurrent ones, e.g. LFM2, Qwen3-Next, Jamba).

    >>> memory_kind(False, False), memory_kind(True, False), memory_kind(False, True)
    ('attention', 'recurrent', 'hybrid')
    """
    return "hybrid" if hybrid else "recurrent" if recurrent else "attention"


def gpu_split_params(params, main_gpu: int, split_mode: str, tensor_split: tuple[float, ...] | None) -> dict:
    """Set how the model spreads over GPUs on llama_model_params; returns what was set (for info and tests).
    The tensor_split array must outlive the load: it is returned (as `_array`) for the caller to keep."""
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {split_mode!r}")
    params.main_gpu = main_gpu
    params.split_mode = SPLIT_MODES[split_mode]
    out = {"main_gpu": main_gpu, "split_mode": split_mode, "tensor_split": None, "_array": None}
    if tensor_split:
        n = int(llama_cpp.llama_max_devices())
        if len(tensor_split) > n:
            raise ValueError(f"tensor_split has {len(tensor_split)} shares; this llama.cpp build takes at most {n}")
        arr = (ctypes.c_float * n)(*[float(x) for x in tensor_split])
        params.tensor_split = ctypes.cast(arr, ctypes.POINTER(ctypes.c_float))
        out.update(tensor_split=tuple(float(x) for x in tensor_split), _array=arr)
    return out


class Model:
    """llama_model + llama_vocab. Thread-safe for tokenizer calls (read-only)."""

    def __init__(
        self,
        path_or_alias: str,
        *,
        n_gpu_layers: int | None = None,
        main_gpu: int = 0,
        split_mode: str = "layer",
        tensor_split: tuple[float, ...] | None = None,
        use_extra_bufts: bool | None = None,
        chat_template: str | None = None,
        vocab_only: bool = False,
        load_mtp: bool = False,
    ) -> None:
        lib.ensure_backend()
        self.name = path_or_alias
        self.path = resolve_model(path_or_alias)
        params = llama_cpp.llama_model_default_params()
        # None: all layers where a GPU is visible (lib.resolve_gpu_layers), so companions follow the target
        self.n_gpu_layers = lib.resolve_gpu_layers(n_gpu_layers)
        params.n_gpu_layers = self.n_gpu_layers
        self.gpu_split = gpu_split_params(params, main_gpu, split_mode, tensor_split)
        # AMX kernels sit behind the "extra" buffer types; on AMX builds they
        # segfault at the first decode here, so never use them on such a build.
        if use_extra_bufts is None:
            use_extra_bufts = not lib.build_has_amx()
        if lib.build_has_amx() and use_extra_bufts:
            raise ValueError("use_extra_bufts=True on an AMX build crashes at the first decode; refusing")
        params.use_extra_bufts = use_extra_bufts
        self.use_extra_bufts = use_extra_bufts
        params.vocab_only = vocab_only  # tokenizer + chat template only (router process of a deployment)
        self.vocab_only = vocab_only
        params.load_mtp = load_mtp  # NextN (MTP) blocks: only an MTP context (the `mtp` speculator) runs them
        self.load_mtp = load_mtp
        self.ptr = llama_cpp.llama_model_load_from_file(self.path.encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load model {self.path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.ptr))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.ptr))
        # what a rejected draft does to this model's memory (engine/rollback.py picks how to undo it)
        self.memory_kind = memory_kind(bool(llama_cpp.llama_model_is_recurrent(self.ptr)),
                                       bool(llama_cpp.llama_model_is_hybrid(self.ptr)))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.add_eos = bool(llama_cpp.llama_vocab_get_add_eos(self.vocab))
        self._eog = np.array(
            [bool(llama_cpp.llama_vocab_is_eog(self.vocab, t)) for t in range(self.n_vocab)], dtype=bool
        )
        self.eog_ids = frozenset(int(t) for t in np.flatnonzero(self._eog))
        self.chat_template = chat_template or self._gguf_template() or default_template_for(path_or_alias)
        self._jinja = bool(self.chat_template) and is_jinja(self.chat_template) and self._compiles(self.chat_template)
        self._piece_cache: dict[int, bytes] = {}
        self._lock = threading.Lock()
        # the GrammarCompiler every part serving this model shares (native/grammar.py GrammarCompiler.of makes
        # it at first use): its compiled grammars live as long as the model
        self.grammar_compiler = None

    # ---- facts -------------------------------------------------------------
    @property
    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    @property
    def n_params(self) -> int:
        """Weights in the model, as llama.cpp counts them."""
        return int(llama_cpp.llama_model_n_params(self.ptr))

    def vocab_info(self) -> VocabInfo:
        return VocabInfo(
            int(llama_cpp.llama_vocab_type(self.vocab)), self.n_vocab, self.bos, self.eos, self.add_bos, self.add_eos
        )

    def token_text(self, token: int) -> bytes:
        return llama_cpp.llama_vocab_get_text(self.vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token])

    def _compiles(self, template: str) -> bool:
        try:
            compile_template(template)
            return True
        except Exception as e:  # not valid Jinja: llama.cpp's built-in formatter may still know its family
            log.warning("chat template of %s is not valid Jinja (%s); using llama.cpp's built-in formatter", self.name, e)
            return False

    def _gguf_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8") if raw else None

    # ---- tokenizer ---------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        return np.ctypeslib.as_array(buf)[:n].astype(np.int32)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        key = token if not special else -1 - token
        piece = self._piece_cache.get(key)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            piece = buf.raw[:n]
            self._piece_cache[key] = piece
        return piece

    def detokenize(self, tokens, special: bool = False) -> str:
        return b"".join(self.token_to_piece(int(t), special) for t in tokens).decode("utf-8", "replace")

    # ---- chat --------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Format chat messages with the model's template.

        Jinja template text is rendered (as llama-server and HF transformers do, so a
        template's default system prompt is kept); a template name goes to llama.cpp's
        built-in formatter.
        """
        if not self.chat_template:
            raise ValueError(
                f"model {self.name} has no chat template; name one (e.g. chat_template='chatml') or send a raw prompt"
            )
        if not messages:
            raise ValueError("messages must not be empty")
        if self._jinja:
            return render_chat(
                self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.bos), eos_token=self._special_text(self.eos), tools=tools,
            )
        messages = tool_messages(messages, tools)  # llama.cpp's built-in formatters know no tools
        arr = (llama_cpp.llama_chat_message * len(messages))()
        keep = []
        for i, m in enumerate(messages):
            role = str(m.get("role", "")).encode()
            content_b = message_text(m.get("content")).encode()
            keep += [role, content_b]
            arr[i].role = role
            arr[i].content = content_b
        tmpl = self.chat_template.encode()
        size = 4096 + sum(len(k) for k in keep) * 2
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(tmpl, arr, len(messages), add_generation_prompt, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = llama_cpp.llama_chat_apply_template(tmpl, arr, len(messages), add_generation_prompt, buf, n)
        if n < 0:
            raise ValueError(f"llama.cpp does not support the chat template of {self.name}")
        return buf.raw[:n].decode("utf-8", "replace")

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray:
        """Template-formatted prompt tokens (`tools`: functions the model may call, chat_template.render_chat).
        The template carries its own BOS where needed."""
        return self.template_tokens(self.apply_chat_template(messages, tools=tools))

    def template_tokens(self, text: str) -> np.ndarray:
        """Tokens of chat-template text (special tokens parsed; a BOS added only where the text lacks one)."""
        return self.tokenize(text, add_special=self.add_bos and not self._text_has_bos(text), parse_special=True)

    def _special_text(self, token: int) -> str:
        return self.token_text(token).decode("utf-8", "replace") if token >= 0 else ""

    def _text_has_bos(self, text: str) -> bool:
        if self.bos < 0:
            return False
        bos_text = self._special_text(self.bos)
        return bool(bos_text) and text.startswith(bos_text)

    def close(self) -> None:
        if getattr(self, "ptr", None):
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass
