"""The public entry point: ``LLM(model=..., mode=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Any, Callable, Sequence as Seq

from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.engine.llm_engine import LLMEngine
from oasiskv_runtime.engine.sequence import Sequence
from oasiskv_runtime.outputs import RequestOutput
from oasiskv_runtime.sampling_params import SamplingParams


class LLM:
    """An offline engine.

    model: a packaged name (``smollm2-135m``), a random-weight preset (``qwen3-8b``, ``llama-3.1-8b``,
    ``qwen3-32b``), a Hugging Face directory or a ``.gguf`` file. ``overrides`` are engine options by name
    (``kv_cache_bytes``/``kv_cache_gb``, ``block_size``, ``top_k_blocks``, ``fetch_ratio``, ``draft``,
    ``max_num_seqs``, ...; see ``EngineConfig.from_overrides``).
    """

    def __init__(self, model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
                 mode: str = "dense", seed: int = 0, **overrides: Any) -> None:
        self.config = EngineConfig.from_overrides(model, device=device, dtype=dtype, mode=mode, seed=seed,
                                                  **overrides)
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def stats(self):
        return self.engine.stats

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens a request may hold (the model's window)."""
        return self.engine.max_model_len

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a generation (unless ``ignore_eos``)."""
        return set(self.engine.eos_ids)

    def model_info(self) -> dict[str, Any]:
        """What ran: model, engine, device, mode and its sparse settings, whether the weights are random."""
        cfg = self.config
        return {"model": cfg.model, "engine": "embedded", "device": cfg.device, "mode": cfg.mode.value,
                "top_k_blocks": cfg.sparse.top_k_blocks, "fetch_ratio": cfg.sparse.fetch_ratio,
                "draft": cfg.sparse.draft, "random_weights": self.engine.model_config.random_weights}

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer (random-weight preset): "
                                 "pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False) or [0]
        return list(prompt)

    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None,
                 forced_output_ids: list[list[int]] | None = None,
                 reference_output_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs come back in prompt order.

        forced_output_ids: teacher forcing per prompt (measurement: the engine computes what it would
        predict, but appends these tokens).
        reference_output_ids: per prompt, a reference run's continuation that the ``oracle`` draft proposes while
        the outputs follow it (measurement: the look-ahead of a perfect draft; the outputs are sampled).
        """
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        for name, given in (("forced_output_ids", forced_output_ids), ("reference_output_ids", reference_output_ids)):
            if given is not None and len(given) != len(prompts):
                raise ValueError(f"{name}: one list per prompt ({len(prompts)}), got {len(given)}")
        token_ids = [self.encode(p) for p in prompts]
        seqs: list[Sequence] = []
        for i, (ids, p) in enumerate(zip(token_ids, plist)):
            seq = self.engine.add_request(ids, p, request_id=str(i))
            if forced_output_ids is not None:
                seq.forced_output_ids = list(forced_output_ids[i])
            if reference_output_ids is not None:
                seq.reference_output_ids = list(reference_output_ids[i])
            seqs.append(seq)
        while self.engine.has_unfinished():
            for seq in self.engine.step():
                if on_finish is not None:
                    on_finish(self._output(seq, prompts[int(seq.request_id)]))
        return [self._output(s, p) for s, p in zip(seqs, prompts)]

    def _output(self, seq: Sequence, prompt: str | list[int]) -> RequestOutput:
        text = seq.text
        if not text and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            finish_reason=seq.finish_reason,
            metrics=self.engine.request_metrics(seq),
        )
