"""Decoding: the engine (target-only and speculative decoding, one round, jitted end to end)
and the one request path from prompts to completions."""

from specjax.decoding import _adaptive as adaptive
from specjax.decoding._adaptive import AdaptiveGamma, RowBudget
from specjax.decoding._batched import (MAX_CACHE_BYTES, BatchedResult, BatchReport, cache_bytes_per_row,
                                       generate_batched, plan_batches)
from specjax.decoding._engine import Engine, GenerationConfig
from specjax.decoding._state import (EOS, MAX_TOKENS, NAN_LOGITS, PAD_ID, RUNNING, STATUS_NAMES, Batch, Commit,
                                     EngineParams, GenerateOutput, LoopState, Metrics, Prefill, StreamEvent)
from specjax.decoding._greedy_check import NEAR_TIE_EPS, RowReport, greedy_check, reference_greedy
from specjax.decoding._request import (REQUEST_ID_LIMIT, Completion, Generator, check_request_id, check_text,
                                       encode_prompt, make_batch, request_keys, timing_summary, token_ids)

__all__ = [
    "AdaptiveGamma", "RowBudget", "adaptive", "EOS", "MAX_TOKENS", "NAN_LOGITS", "PAD_ID", "RUNNING", "STATUS_NAMES",
    "Batch", "Commit", "Engine", "EngineParams", "GenerateOutput", "GenerationConfig", "LoopState", "Metrics",
    "Prefill", "StreamEvent", "NEAR_TIE_EPS", "RowReport", "greedy_check", "reference_greedy",
    "MAX_CACHE_BYTES", "BatchedResult", "BatchReport", "cache_bytes_per_row", "generate_batched",
    "plan_batches",
    "Completion", "Generator", "encode_prompt", "make_batch", "request_keys", "timing_summary",
    "REQUEST_ID_LIMIT", "check_request_id", "check_text", "token_ids",
]
