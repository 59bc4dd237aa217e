"""Resolve a model name to a config, weights and tokenizer.

Accepted: a packaged model name (``smollm2-135m``), a random-weight preset (``qwen3-8b``), a Hugging Face
directory (config.json + *.safetensors, sharded too) or a ``.gguf`` file (de-quantized by transformers'
GGUF support, never by hand). GGUF conversions are cached as safetensors so later loads take a second.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oasiskv_runtime.config import ModelConfig
from oasiskv_runtime.models.assets import PACKAGED
from oasiskv_runtime.models.decoder import DecoderForCausalLM
from oasiskv_runtime.models.llama import LlamaForCausalLM
from oasiskv_runtime.models.presets import preset_config, preset_names
from oasiskv_runtime.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    kind: str  # "preset" | "hf" | "gguf"
    path: Path | None
    name: str


def resolve(model: str) -> ModelSource:
    if model in PACKAGED:
        return ModelSource("gguf", PACKAGED[model].require(), PACKAGED[model].name)
    if model in preset_names():
        return ModelSource("preset", None, model)
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return ModelSource("gguf", p, str(p))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json (expected a Hugging Face model directory)")
        return ModelSource("hf", p, str(p))
    if p.exists():
        raise ValueError(f"{p} is neither a Hugging Face model directory nor a .gguf file")
    if os.sep in model or model.startswith("."):
        raise FileNotFoundError(f"model path not found: {p}")
    known = ", ".join(sorted(set(PACKAGED)) + preset_names())
    raise ValueError(f"unknown model {model!r}: not a path, and not a known name ({known})")


def _cache_root() -> Path:
    return Path(os.path.expanduser("~/.cache/oasiskv"))


def _gguf_cache_dir(path: Path, sample: int = 4 << 20) -> Path:
    """Where a GGUF's conversion is cached: keyed by its content (size, first and last `sample` bytes), not by its
    path or mtime, so the same file installed in another venv (each CI run, each user's venv) reuses one conversion
    instead of adding ~0.5 GB each time."""
    size = path.stat().st_size
    h = hashlib.sha1(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(sample))
        f.seek(max(0, size - sample))
        h.update(f.read(sample))
    return _cache_root() / "gguf" / f"{path.stem}-{h.hexdigest()[:16]}"


def _convert_gguf(path: Path) -> Path:
    """De-quantize a GGUF into a cached HF directory (config.json, model.safetensors, tokenizer files)."""
    out = _gguf_cache_dir(path)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    try:
        import gguf  # noqa: F401  (transformers needs it; fail with our message, not a deep traceback)
    except ImportError:
        raise ImportError("loading GGUF files needs the gguf package: pip install 'gguf>=0.10'") from None
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(hf_config.to_dict(), indent=1, default=str))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(tmp))
    if out.exists():  # another process won the race
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    tmp.rename(out)
    return out


def read_hf_config(directory: Path, name: str) -> ModelConfig:
    try:
        d = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / 'config.json'} is not valid JSON: {e}") from None
    return ModelConfig.from_hf_dict(d, name=name)


def load_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(directory / f)))
    return state


def model_config_for(model: str) -> tuple[ModelConfig, ModelSource, Path | None]:
    """Config without loading weights; also the HF directory holding weights and tokenizer (None: preset)."""
    src = resolve(model)
    if src.kind == "preset":
        return preset_config(src.name), src, None
    directory = _convert_gguf(src.path) if src.kind == "gguf" else src.path
    return read_hf_config(directory, src.name), src, directory


def load_model(model: str, device: str, dtype: str, seed: int = 0) -> tuple[DecoderForCausalLM, Any, ModelConfig]:
    """Build the model on ``device`` in ``dtype``; returns (model, tokenizer or None, config)."""
    config, src, directory = model_config_for(model)
    torch_dtype = DTYPES[dtype]
    cls = ARCHITECTURES[config.architecture]
    if directory is None:
        _check_fits(config, device, torch_dtype)
        with torch.device(device):
            net = cls(config).to(torch_dtype)
        _init_random(net, seed)
        return net.eval(), None, config
    with torch.device("meta"):
        net = cls(config)
    net = net.to_empty(device=device).to(torch_dtype)
    net.rotary = type(net.rotary)(config).to(device)
    net.load_hf_state_dict(load_safetensors_dir(directory))
    return net.eval(), _load_tokenizer(directory), config


def _load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError):
        return None


def load_tokenizer(model: str) -> Any:
    """The tokenizer :func:`load_model` gives ``model`` (None for a random-weight preset), without the weights."""
    _, _, directory = model_config_for(model)
    return None if directory is None else _load_tokenizer(directory)


def eos_token_ids(config: ModelConfig, tokenizer: Any) -> set[int]:
    """The tokens that end a generation: the config's, and the tokenizer's EOS (a chat model's turn end)."""
    ids = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _check_fits(config: ModelConfig, device: str, dtype: torch.dtype) -> None:
    need = config.num_params() * torch.tensor([], dtype=dtype).element_size()
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > free:
        raise MemoryError(f"{config.name}: {need / 2**30:.1f} GiB of weights do not fit in the "
                          f"{free / 2**30:.1f} GiB free on {device}")


@torch.no_grad()
def _init_random(net: DecoderForCausalLM, seed: int) -> None:
    """Random weights at real shapes. Std 0.02 as in HF initialisers; norms stay at one."""
    gen = torch.Generator(device=net.embed_tokens.weight.device).manual_seed(seed)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
