"""llama.cpp's staging API (src/llama-ext.h) for hidden-state speculators, bound with ctypes.

llama-cpp-python 0.3.36 binds part of it in `llama_cpp.llama_cpp_ext`
(nextn embeddings, the NextN layer offset, ctx_other) and `llama_n_layer_nextn`
in `llama_cpp`; the rest is bound here: the per-layer input taps EAGLE-3 reads
from its target (`llama_set/get_embeddings_layer_inp`), the target layer ids an
EAGLE-3 / DFlash draft declares (`llama_model_target_layer_ids(_n)`), the token
embedding matrix (`llama_model_get_tok_embd`) and DFlash's selector top-k.

llama-ext.h is C++ (no extern "C"), so each symbol is looked up under its
plain name and its Itanium / MSVC mangled names, as llama_cpp_ext does.
`missing()` lists what this build lacks, so callers can report it instead of
failing on first use.
"""

from __future__ import annotations

import ctypes

import llama_cpp
from llama_cpp import llama_cpp_ext as _ext

_lib = llama_cpp.llama_cpp._lib
_ctx_p = llama_cpp.llama_context_p_ctypes
_model_p = llama_cpp.llama_model_p_ctypes
_float_p = ctypes.POINTER(ctypes.c_float)

_missing: dict[str, str] = {}


def _bind(names: tuple[str, ...], argtypes: list, restype):
    for name in names:
        fn = getattr(_lib, name, None)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = restype
            return fn
    _missing[names[0]] = f"none of the symbols {', '.join(names)} is exported by {_lib._name}"

    def unavailable(*_args):
        raise NotImplementedError(f"{names[0]}: {_missing[names[0]]}")

    return unavailable


# LLAMA_API void llama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
llama_set_embeddings_layer_inp = _bind(
    ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
     "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
    [_ctx_p, ctypes.c_uint32, ctypes.c_bool], None)

# LLAMA_API float * llama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
llama_get_embeddings_layer_inp = _bind(
    ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
     "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
    [_ctx_p, ctypes.c_uint32], _float_p)

# LLAMA_API const int32_t * llama_model_target_layer_ids(const struct llama_model * model);
llama_model_target_layer_ids = _bind(
    ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
     "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z"),
    [_model_p], ctypes.POINTER(ctypes.c_int32))

# LLAMA_API uint32_t llama_model_target_layer_ids_n(const struct llama_model * model);
llama_model_target_layer_ids_n = _bind(
    ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
     "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z"),
    [_model_p], ctypes.c_uint32)

# LLAMA_API uint32_t llama_model_get_tok_embd(const struct llama_model * model, float * out);
llama_model_get_tok_embd = _bind(
    ("llama_model_get_tok_embd", "_Z24llama_model_get_tok_embdPK11llama_modelPf",
     "?llama_model_get_tok_embd@@YAIPEBUllama_model@@PEAM@Z"),
    [_model_p, _float_p], ctypes.c_uint32)

# LLAMA_API int32_t llama_model_dflash_selector_top_k(const struct llama_model * model);
llama_model_dflash_selector_top_k = _bind(
    ("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model",
     "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z"),
    [_model_p], ctypes.c_int32)

# bound by llama-cpp-python (re-exported so callers use one module)
llama_set_embeddings_nextn = _ext.llama_set_embeddings_nextn
llama_get_embeddings_nextn = _ext.llama_get_embeddings_nextn
llama_get_embeddings_nextn_ith = _ext.llama_get_embeddings_nextn_ith
llama_set_nextn_layer_offset = _ext.llama_set_nextn_layer_offset
llama_get_ctx_other = _ext.llama_get_ctx_other
llama_model_n_layer_nextn = llama_cpp.llama_model_n_layer_nextn
llama_model_n_embd_out = llama_cpp.llama_model_n_embd_out

#: llama_context_params.ctx_type
LLAMA_CONTEXT_TYPE_DEFAULT = 0
LLAMA_CONTEXT_TYPE_MTP = 1


def missing() -> dict[str, str]:
    """Bindings this llama.cpp build does not export: name -> reason."""
    return dict(_missing)


def target_layer_ids(model_ptr) -> tuple[int, ...]:
    """The target layers an EAGLE-3 / DFlash draft model reads (empty for other models)."""
    n = int(llama_model_target_layer_ids_n(model_ptr))
    if n == 0:
        return ()
    ids = llama_model_target_layer_ids(model_ptr)
    return tuple(int(ids[i]) for i in range(n))


def n_layer_nextn(model_ptr) -> int:
    """NextN (MTP) blocks the model carries after its trunk."""
    return int(llama_model_n_layer_nextn(model_ptr))
