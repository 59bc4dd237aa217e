"""The one config tree: every option declared once (default, check, one-line doc), routed by name, round-tripped, and
the same rules where oasisbench takes it (flags, suites)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from oasisbench.cli.options import engine_option
from oasisbench.suites import ENGINE_KEYS, OPTION_SPECS
from oasiskv_runtime.config import EngineConfig, KernelConfig, PDConfig, SparseConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_option_has_one_section_a_one_line_doc_and_a_row_in_the_docs():
    opts = EngineConfig.options()
    text = DOCS.read_text()
    assert len(opts) >= 25
    for name, spec in opts.items():
        assert spec.doc and "\n" not in spec.doc and spec.expect, name
        assert f"| `{name}`" in text, f"docs/configuration.md has no row for {name}"
    # sections: the algorithm apart from kernel A/B switches and measurement switches
    assert {opts[n].section for n in ("top_k_blocks", "fetch_ratio", "draft", "sink_blocks", "dense_layers",
                                      "link_gbps")} == {"sparse"}
    assert {opts[n].section for n in ("backend", "select_kernel", "gather_ctas", "cuda_graphs")} == {"kernels"}
    assert {opts[n].section for n in ("measure_recall", "disable_transfers")} == {"debug"}
    assert {opts[n].section for n in ("transfer", "transport", "prefix_cache")} == {"pd"}


def test_defaults_validate_and_bad_values_name_the_option():
    opts = EngineConfig.options()
    for spec in opts.values():
        spec.validate(spec.default)
    for name, bad in (("top_k_blocks", 0), ("fetch_ratio", 0.0), ("fetch_ratio", 1.5), ("block_size", 12),
                      ("dense_layers", -1), ("backend", "gpu"), ("gather_copies", 3), ("transfer", "some"),
                      ("kv_cache_bytes", -1), ("max_num_seqs", 0)):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            EngineConfig.from_overrides("qwen3-8b", **{name: bad})
    with pytest.raises(ValueError, match="sink_blocks must be in"):
        SparseConfig(top_k_blocks=4, sink_blocks=4)
    with pytest.raises(ValueError, match="kv_cache_gb must be a positive number"):
        EngineConfig.from_overrides("qwen3-8b", kv_cache_gb=-1)


def test_routing_round_trip_and_unknown_names():
    cfg = EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", top_k_blocks=64, backend="ref", transfer="full",
                                      measure_recall=True, kv_cache_gb=2, draft="ngram")
    assert cfg.sparse.top_k_blocks == 64 and cfg.kernels == KernelConfig(backend="ref")
    assert cfg.pd == PDConfig(transfer="full") and cfg.debug.measure_recall and cfg.cache.kv_cache_bytes == 2 << 30
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert EngineConfig.from_dict({"model": "qwen3-8b", "sparse": {"top_k_blocks": 8}}).sparse.top_k_blocks == 8
    with pytest.raises(TypeError, match="unknown engine option 'topk'"):
        EngineConfig.from_overrides("qwen3-8b", topk=3)
    with pytest.raises(ValueError, match="unknown engine config keys: bogus"):
        EngineConfig.from_dict({"model": "qwen3-8b", "bogus": 1})


def test_oasisbench_takes_the_same_rules():
    """A suite key and a CLI flag of an engine option accept and refuse what the runtime does."""

    opts = EngineConfig.options()
    for name in ENGINE_KEYS:
        check, expect = OPTION_SPECS[name]
        assert expect == opts[name].expect and check(opts[name].default) and check(None), name
    assert not OPTION_SPECS["fetch_ratio"][0](0.0) and not OPTION_SPECS["dense_layers"][0]([0, 1])

    app = typer.Typer()

    @app.command()
    def cmd(k: Annotated[int, engine_option("top_k_blocks")] = 128) -> None:
        typer.echo(f"k={k}")

    r = CliRunner().invoke(app, ["--top-k-blocks", "0"])
    assert r.exit_code == 2 and "top_k_blocks must be positive" in r.output
    r = CliRunner().invoke(app, ["--top-k-blocks", "7"])
    assert r.exit_code == 0 and "k=7" in r.output
