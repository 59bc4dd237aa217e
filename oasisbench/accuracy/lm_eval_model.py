"""lm-eval model ``oasiskv``: lm-evaluation-harness drives our in-process engine in any mode, or (``llm`` given)
any engine with the same ``generate`` / ``tokenizer`` / ``max_model_len`` / ``eos_ids`` / ``model_info`` (the
accuracy runner's vLLM engine: generative tasks through vLLM + OasisKV).

``generate_until`` sends every request of a call through ONE ``LLM.generate`` call, so the engine batches them
continuously, exactly as a served workload would be; sparse modes decode with their own attention path.
``loglikelihood`` teacher-forces the continuation through engine steps (see
:mod:`oasisbench.accuracy.scoring`), so continuation tokens after the first are scored by decode steps too.

Example (Python)::

    from lm_eval import simple_evaluate
    from oasisbench.accuracy.lm_eval_model import OasisKVLM

    lm = OasisKVLM(model="smollm2-135m", mode="oasiskv", top_k_blocks=64)
    out = simple_evaluate(model=lm, tasks=["aime24"], task_manager=tm, apply_chat_template=True)

Example (lm-eval CLI, with the module imported so the name is registered)::

    python -c "import oasisbench.accuracy.lm_eval_model, lm_eval.__main__ as m; m.cli_evaluate()" \\
        --model oasiskv --model_args model=smollm2-135m,mode=dense --tasks aime24 --include_path suites/accuracy
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import jinja2
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from oasisbench.accuracy.scoring import engine_loglikelihood
from oasiskv_runtime import LLM, SamplingParams

#: Generation budget when a task does not say (lm-eval's HFLM default).
DEFAULT_MAX_GEN_TOKS = 256


def _bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


@register_model("oasiskv")
class OasisKVLM(LM):
    """An lm-eval ``LM`` over :class:`oasiskv_runtime.LLM`.

    Build it from engine arguments (what ``--model_args`` carries) or hand it an existing ``llm``.
    ``max_length`` caps prompt + generation below the model's window (LongBench v2 truncation budget).
    """

    def __init__(self, model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
                 mode: str = "dense", top_k_blocks: int = 128, fetch_ratio: float = 0.05, draft: str = "auto",
                 kv_cache_gb: float | None = None, max_num_seqs: int = 256, seed: int = 0,
                 llm: LLM | None = None, max_length: int | None = None, **_: Any) -> None:
        # **_: lm-eval passes batch_size / max_batch_size / device hints; continuous batching makes them moot.
        super().__init__()
        if llm is None:
            llm = LLM(str(model), device=str(device or "cpu"), dtype=str(dtype), mode=str(mode), seed=int(seed),
                      top_k_blocks=int(top_k_blocks), fetch_ratio=float(fetch_ratio), draft=str(draft),
                      kv_cache_gb=None if kv_cache_gb in (None, "", "None") else float(kv_cache_gb),
                      max_num_seqs=int(max_num_seqs))
        self.llm = llm
        self.seed = int(seed)
        window = llm.max_model_len
        self.max_length = min(int(max_length), window) if max_length else window
        self._device = llm.model_info()["device"]
        self.num_output_tokens = 0
        self.num_prompt_tokens = 0
        self.generate_seconds = 0.0
        self.num_truncated_prompts = 0

    # ---- what lm-eval asks about the model ----------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def tokenizer_name(self) -> str:
        """Fingerprints lm-eval's request cache (same convention as HFLM)."""
        tok = self.tokenizer
        return (getattr(tok, "name_or_path", None) or str(self.llm.model_info()["model"])).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template text lm-eval records in its config; None when disabled or absent."""
        if chat_template is False or chat_template is None or self.tokenizer is None:
            return None
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            name = chat_template if isinstance(chat_template, str) else "default"
            return template.get(name)
        return template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a chat as prompt text. Templates that reject a system turn get it dropped, as HFLM does."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.llm.model_info()['model']!r} has no chat template; run without it")
        kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except jinja2.exceptions.TemplateError:
            chat_history = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)

    def get_model_info(self) -> dict[str, Any]:
        return self.llm.model_info()

    # ---- encoding --------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.llm.model_info()['model']!r} has no tokenizer (random-weight preset): "
                             "text tasks need a real tokenizer")
        # No special tokens, like HFLM: chat-templated text already carries BOS and role tokens.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prefix_token(self) -> int:
        """Token that conditions an empty context (lm-eval's convention: BOS, else EOS)."""
        tok = self.tokenizer
        for tid in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)):
            if tid is not None:
                return int(tid)
        return sorted(self.llm.eos_ids)[0]

    def _fit(self, prompt: list[int], max_gen: int) -> tuple[list[int], int]:
        """Prompt and generation budget within ``max_length``. Generation gets what the prompt leaves, but
        never less than half the window (or its own budget); a prompt that still does not fit loses its
        middle, keeping the instruction at the start and the question at the end (LongBench v2's truncation)."""
        room = self.max_length - 1  # the engine needs prompt < window; one slot of slack
        if len(prompt) + max_gen <= room:
            return prompt, max_gen
        gen = min(max_gen, max(room - len(prompt), room // 2))
        keep = room - gen
        if len(prompt) > keep:
            self.num_truncated_prompts += 1
            prompt = prompt[: keep // 2] + prompt[len(prompt) - (keep - keep // 2):]
        return prompt, gen

    # ---- the three request types ---------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prompts: list[list[int]] = []
        params: list[SamplingParams] = []
        stops: list[list[str]] = []
        seen: dict[int, int] = {}
        special = set(getattr(self.tokenizer, "all_special_tokens", None) or [])
        for req in requests:
            context, gen_kwargs = req.args[0], dict(req.args[1] or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            sample = _bool(gen_kwargs.get("do_sample", False))
            # Greedy unless the task samples; do_sample without a temperature means plain sampling.
            temperature = float(gen_kwargs.get("temperature") or 1.0) if sample else 0.0
            top_p = float(gen_kwargs.get("top_p") or 1.0) if sample else 1.0
            top_k = int(gen_kwargs.get("top_k") or 0) if sample else 0
            prompt, max_tokens = self._fit(self._encode(context), max_gen)
            # Repeats of one document arrive as the same Instance k times: give each its own sampling seed,
            # derived from content (not position) so --limit does not change a document's samples.
            rep = seen[id(req)] = seen.get(id(req), -1) + 1
            seed = zlib.crc32(f"{self.seed}|{rep}|{context}".encode()) & 0x7FFFFFFF
            # Special-token stops ("<|im_end|>") can never match the engine's text (decoded without special
            # tokens; EOS ends those turns), and every stop string costs a decode of the output per step.
            engine_stops = [s for s in until if s and s not in special]
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                         seed=seed, stop=engine_stops))
            prompts.append(prompt)
            stops.append(until)
        if not prompts:
            return []
        start, engine_s = time.perf_counter(), getattr(self.llm, "generate_seconds", None)
        outs = self.llm.generate(prompts, params)
        # an engine that times its own generation (vLLM's child: its start is not generation) is taken at its word
        self.generate_seconds += (self.llm.generate_seconds - engine_s if engine_s is not None
                                  else time.perf_counter() - start)
        texts = []
        for req, out, until in zip(requests, outs, stops):
            self.num_output_tokens += len(out.token_ids)
            self.num_prompt_tokens += len(out.prompt_token_ids)
            text = out.text
            for s in until:  # the engine trims at a stop string already; this also covers special tokens
                text = text.split(s)[0] if s else text
            texts.append(text)
            if self.cache_hook is not None:
                self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation) split as lm-eval's TemplateLM does: trailing context spaces
        move to the continuation and the whole string is encoded once, so merges across the seam count."""
        if not context:
            return [self._prefix_token()], self._encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return ctx, whole[len(ctx):]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        fitted = []
        for ctx, cont in pairs:
            cont = cont[-(self.max_length - 1):]
            ctx = ctx[-(self.max_length - len(cont)):] or [self._prefix_token()]  # keep the context's end
            fitted.append((ctx, cont))
        if fitted and not isinstance(self.llm, LLM):
            raise ValueError("loglikelihood requests (multiple-choice scoring) are teacher-forced through the embedded "
                             "engine's steps; on vLLM only generative tasks run")
        return engine_loglikelihood(self.llm, fitted) if fitted else []

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Teacher-forced through engine steps: in sparse modes, decode steps score the continuation."""
        results = self._score([self._pair(*req.args[:2]) for req in requests])
        for req, res in zip(requests, results):
            if self.cache_hook is not None:
                self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Perplexity-style scoring of whole texts in disjoint windows of the model's length."""
        windows: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            ids = self._encode(req.args[0])
            for w in get_rolling_token_windows(ids, self._prefix_token(), self.max_length - 1, 1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(windows)):
            totals[i] += logprob
        return totals

    # ---- run statistics -------------------------------------------------------------------------------------
    def throughput(self) -> dict[str, float | int | None]:
        """Generated tokens per second over generate_until calls (vLLM's output_throughput)."""
        secs = self.generate_seconds
        return {"output_throughput": self.num_output_tokens / secs if secs > 0 else None,
                "total_output_tokens": self.num_output_tokens, "total_input_tokens": self.num_prompt_tokens,
                "duration": secs, "num_truncated_prompts": self.num_truncated_prompts}
