"""The model runner: owns the device tensors (weights, KV cache) and turns one SchedulerOutput into logits.

Tokens of all scheduled requests are packed into one flat batch (no padding); attention finds each
request's keys through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.model_defs import ModelConfig
from kiln.model_defs.layers import ForwardContext

from .scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [R, V] float32: one row per request with `sample` set, in schedule order
    sample_ids: tuple[str, ...]  # request id of each logits row
    # request id -> (first prompt position p, logprobs of prompt[p+1], prompt[p+2], ...) for requests that
    # asked for prompt logprobs and computed prompt tokens this step.
    prompt_logprobs: dict[str, tuple[int, list[float]]]


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                 num_kv_blocks: int, block_size: int, max_seq_len: int) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.block_size = block_size
        model.setup_rotary(max_seq_len, device)
        # Allocated once for the engine's lifetime: graphs captured later read these addresses.
        # kv_cache: [layers, 2, num_blocks, block_size, Hk, D]
        self.kv_cache = torch.zeros(config.num_layers, 2, num_kv_blocks, block_size, config.num_kv_heads,
                                    config.head_dim, dtype=dtype, device=device)
        self.kv_caches = tuple((self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(config.num_layers))

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, prompts_for_logprobs: dict[str, list[int]] | None = None) -> StepResult:
        """Runs one step. `prompts_for_logprobs` maps the requests that want prompt logprobs to their prompt
        token ids (the targets that this step's positions predict)."""
        ctx, input_ids, sample_rows, sample_ids = self._prepare(step)
        hidden = self.model(input_ids, ctx)  # [T, H]
        logits = self.model.compute_logits(hidden[sample_rows])  # [R, V]
        prompt_logprobs = self._prompt_logprobs(step, hidden, prompts_for_logprobs) if prompts_for_logprobs else {}
        return StepResult(logits, sample_ids, prompt_logprobs)

    def _prepare(self, step: SchedulerOutput) -> tuple[ForwardContext, torch.Tensor, torch.Tensor, tuple[str, ...]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        rope_lengths: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        max_blocks = max(len(r.block_ids) for r in step.requests)
        tables: list[list[int]] = []
        for r in step.requests:
            n = len(r.token_ids)
            span = range(r.start_position, r.start_position + n)
            input_ids.extend(r.token_ids)
            positions.extend(span)
            rope_lengths.extend(max(p + 1, r.num_prompt_tokens) for p in span)
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in span)
            seq_lens.append(r.start_position + n)
            starts.append(starts[-1] + n)
            tables.append(list(r.block_ids) + [0] * (max_blocks - len(r.block_ids)))
            if r.sample:
                sample_rows.append(starts[-1] - 1)
                sample_ids.append(r.request_id)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        ctx = ForwardContext(
            positions=tensor(positions, torch.int64),
            rope_lengths=tensor(rope_lengths, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(starts, torch.int32),
            kv_caches=self.kv_caches,
        )
        return ctx, tensor(input_ids, torch.int64), tensor(sample_rows, torch.int64), tuple(sample_ids)

    def _prompt_logprobs(self, step: SchedulerOutput, hidden: torch.Tensor,
                         prompts: dict[str, list[int]]) -> dict[str, tuple[int, list[float]]]:
        # Position p's logits predict token p+1; only prompt tokens followed by a prompt token count.
        result: dict[str, tuple[int, list[float]]] = {}
        offset = 0
        for r in step.requests:
            n = len(r.token_ids)
            first, last = r.start_position, min(r.start_position + n, r.num_prompt_tokens - 1)
            if r.request_id in prompts and last > first:
                rows = hidden[offset:offset + (last - first)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)  # [last-first, V]
                targets = prompts[r.request_id][first + 1:last + 1]
                picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
                result[r.request_id] = (first, picked.squeeze(1).tolist())
            offset += n
        return result
