"""`SamplingParams.logit_bias` (vLLM's and OpenAI's; TensorRT-LLM's embedding_bias arrives as one): a number
added to a token's logit before penalties, masks and sampling. Logprobs stay the model's own distribution."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.plugins.host_tensors import to_device


def apply_logit_bias(logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """`logits` ([B, V] float32) with each row's bias added: a new tensor, or `logits` itself when no row has
    one (the common case costs one pass over the rows). `rows`: SamplingRow-likes (`.params.logit_bias`); token
    ids were checked against V when the request was added."""
    biased = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return logits
    row_ids = [i for i, bias in biased for _ in bias]
    token_ids = [t for _, bias in biased for t in bias]
    values = [v for _, bias in biased for v in bias.values()]
    device = logits.device
    return logits.index_put((to_device(row_ids, torch.int64, device), to_device(token_ids, torch.int64, device)),
                            to_device(values, torch.float32, device), accumulate=True)
