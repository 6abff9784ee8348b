"""The target's whole embedding table on rank 0, for an EAGLE-3 head that shares it, when the target is split
over tensor-parallel ranks: rank 0's network holds only its vocabulary shard (`VocabParallelEmbedding`).

The other ranks' rows are read from their rank files, not gathered: a collective would need a matching call on
every other rank, which runs nothing but steps. The builder cuts the table by `vocab_shard`: rank r holds rows
[r * ceil(V / tp), (r + 1) * ceil(V / tp)) of the vocabulary padded with zero rows to a multiple of tp_size.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from kiln.engine_format import EngineError
from kiln.runtime.worker.engine_loader import EngineInfo

EMBEDDING = "model.embed_tokens.weight"  # DecoderForCausalLM's embedding, as the rank files name it


@torch.no_grad()
def full_target_embedding(target: EngineInfo, local: torch.Tensor) -> torch.Tensor:
    """[V, H] on `local`'s device and dtype: `local` (rank 0's rows, [ceil(V / tp), H]) and the other ranks' rows
    read from their rank files, in rank order, the padding rows dropped; `local` itself at tp_size 1. An engine
    built without weight files drew every rank's rows at load from the same seed by name and shape
    (`dummy_weights.py`), so each rank's rows are rank 0's. An EngineError names a file that cannot be read or
    rows of another shape."""
    tp, vocab = target.config.mapping.tp_size, target.model_config.vocab_size
    if tp == 1:
        return local
    if local.shape[0] * tp < vocab:
        raise EngineError(f"the target's embedding rows on rank 0 ({local.shape[0]}) times tp_size {tp} do not "
                          f"cover its vocabulary of {vocab} tokens")
    shards = [local]
    for rank in range(1, tp):
        if target.config.build.weights_at_load:
            shards.append(local)
            continue
        path = target.spec.rank_file(rank)
        try:
            with safe_open(str(path), framework="pt") as f:
                rows = f.get_tensor(EMBEDDING)  # [ceil(V / tp), H], on the CPU
        except Exception as e:  # safetensors raises its own error types
            raise EngineError(f"EAGLE-3 head: cannot read the target's embedding rows ({EMBEDDING}) from {path}: "
                              f"{e}; rebuild the target engine") from e
        if rows.shape != local.shape:
            raise EngineError(f"EAGLE-3 head: {path} holds {EMBEDDING} of shape {list(rows.shape)}, rank 0 "
                              f"{list(local.shape)}: the engine's rank files disagree; rebuild the target engine")
        shards.append(rows.to(device=local.device, dtype=local.dtype))
    return torch.cat(shards)[:vocab]  # [V, H]
