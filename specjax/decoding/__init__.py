"""Generation loops: target-only and speculative decoding, jitted end to end."""

from specjax.decoding._adaptive import AdaptiveGamma
from specjax.decoding._stream import (StreamEvent, calibrate_round_times, init_state, run_stream, step,
                                      stream_generate, timing_summary)
from specjax.decoding._engine import (EOS, MAX_TOKENS, NAN_LOGITS, PAD_ID, RUNNING, STATUS_NAMES,
                                      GenerateOutput, GenerationConfig, Metrics, autoregressive_generate,
                                      capacity_for, pad_prompts, request_keys, speculative_generate)

__all__ = [
    "AdaptiveGamma", "EOS", "MAX_TOKENS", "NAN_LOGITS", "PAD_ID", "RUNNING", "STATUS_NAMES",
    "GenerateOutput", "GenerationConfig", "Metrics", "autoregressive_generate", "capacity_for",
    "pad_prompts", "request_keys", "speculative_generate",
    "StreamEvent", "calibrate_round_times", "init_state", "run_stream", "step", "stream_generate",
    "timing_summary",
]
