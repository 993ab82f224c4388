"""llama-cpp-python's own generate loop (`llama_cpp.Llama`), for the bench's reference column.

It is what a user of llama-cpp-python would run: the same model file and
threads as the engine, greedy, one sequence. The bench times it decode by
decode, in lockstep with specray's configurations.
"""

from __future__ import annotations

from collections.abc import Iterator


class ReferenceLoop:
    def __init__(self, model_path: str, threads: int, n_ctx: int, eog_ids, n_gpu_layers: int = 0) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_gpu_layers=n_gpu_layers, verbose=False)
        self.eog = set(int(t) for t in eog_ids)

    def greedy(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[str, int | None]]:
        """Yields after each decode: ("prompt", tok) for the one that processed the prompt, ("token", tok) for
        the others; tok is None where the decode produced end of generation (nothing more comes)."""
        self.llm.reset()
        n = 0
        for t in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            kind = "prompt" if n == 0 else "token"
            if t in self.eog:
                yield kind, None
                return
            n += 1
            yield kind, t
            if n >= max_tokens:
                return
