"""llama.cpp's side of ``benchmarks/quant_throughput.py``, run by the llama-cpp-python venv's
interpreter (it imports nothing of twinserve): loads the GGUF once, then for each JSON line on
stdin ``{"prompts": [[ids]], "max_tokens": n}`` decodes every prompt greedily as one sequence of
one batch (``llama_decode`` over all sequences at once, as llama.cpp's batched example) and
prints ``{"seconds": s, "first": [ids of sequence 0]}``.

    /work/peers/llamacpp/bin/python benchmarks/llamacpp_worker.py FILE.gguf THREADS MAX_SEQS
"""

import ctypes
import json
import sys
import time

import llama_cpp as L
import numpy as np


def _call(*names):
    for name in names:
        if hasattr(L, name):
            return getattr(L, name)
    raise AttributeError(f"llama_cpp has none of {names}")


def main() -> None:
    path, threads, max_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    L.llama_backend_init()
    model = _call("llama_model_load_from_file", "llama_load_model_from_file")(
        path.encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = 256 * max_seqs
    params.n_batch = params.n_ubatch = 2048
    params.n_seq_max = max_seqs
    params.n_threads = params.n_threads_batch = threads
    ctx = _call("llama_init_from_model", "llama_new_context_with_model")(model, params)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = _call("llama_vocab_n_tokens")(vocab)
    batch = L.llama_batch_init(2048, 0, max_seqs)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        first = run(ctx, batch, n_vocab, job["prompts"], job["max_tokens"])
        print(json.dumps({"seconds": time.perf_counter() - start, "first": first}), flush=True)


def clear(ctx) -> None:
    if hasattr(L, "llama_memory_clear"):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
    else:
        _call("llama_kv_self_clear", "llama_kv_cache_clear")(ctx)


def decode(ctx, batch, entries) -> None:
    """``entries``: (token, position, sequence, wants_logits) in one llama_decode call."""
    batch.n_tokens = len(entries)
    for i, (tok, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i] = tok, pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    if L.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def greedy(ctx, index: int, n_vocab: int) -> int:
    ptr = L.llama_get_logits_ith(ctx, index)
    return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(n_vocab,)).argmax())


def run(ctx, batch, n_vocab, prompts, max_tokens):
    clear(ctx)
    entries = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts)
               for p, t in enumerate(prompt)]
    decode(ctx, batch, entries)
    rows = [i for i, e in enumerate(entries) if e[3]]
    last = [greedy(ctx, r, n_vocab) for r in rows]
    out = [[tok] for tok in last]
    for step in range(1, max_tokens):
        decode(ctx, batch, [(last[s], len(prompts[s]) + step - 1, s, True)
                            for s in range(len(prompts))])
        last = [greedy(ctx, s, n_vocab) for s in range(len(prompts))]
        for s, tok in enumerate(last):
            out[s].append(tok)
    return out[0]


if __name__ == "__main__":
    main()
