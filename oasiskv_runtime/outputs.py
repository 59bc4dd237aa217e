"""What ``LLM.generate`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    """Per-request metrics: ttft_ms, tpot_ms, itl_ms list, num_preemptions, and in sparse modes fetched
    blocks/bytes, deferred blocks, resident device bytes, draft accuracy, recall."""
