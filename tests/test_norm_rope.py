"""The fused RMSNorm and q/k-norm + rotary kernels against their plain-PyTorch references (odd sizes, strided
views as the fused qkv projection produces them), and the model with them against the model without."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime.ops import norm_rope as nr
from tests.kernel_devices import KERNEL_DEVICES


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _close(a, b, dtype, device, mag=None):
    """Equal up to a last-bit difference where the float32 sum of squares was added in another order (``mag``:
    the magnitude that bit is taken of, default the result's). Triton's interpreter truncates casts to bfloat16
    (the GPU rounds to nearest even), so there a bfloat16 result may be a few last bits off the reference's."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    if dtype == torch.bfloat16 and device == "cpu":   # truncated casts: only the indexing and the math are checked
        torch.testing.assert_close(a.float(), b.float(), rtol=0.03, atol=0.03 * b.float().abs().max().item())
        return
    bits = 8 if dtype == torch.bfloat16 else 11
    diff = (a.float() - b.float()).abs()
    ulp = (b.float().abs() if mag is None else mag).clamp_min(1e-3) * 2.0 ** -(bits - 1)
    assert bool((diff <= ulp).all()), f"max diff {diff.max().item()}"
    if mag is None:  # the norm: the reference's bits but for a rare last bit of the scale
        assert (a != b).float().mean().item() < 0.02, "more than 2% of elements differ"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype,rows,n", [(torch.bfloat16, 37, 576), (torch.float32, 5, 4096),
                                          (torch.float16, 3, 100)])
def test_rms_norm_kernel_matches_ref(dtype, rows, n, device):
    gen = _gen(1)
    base = (torch.randn(rows, n + 7, generator=gen) * 3).to(dtype).to(device)
    x = base[:, 3:n + 3]                                    # a strided row view
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype).to(device)
    ref = nr.rms_norm_ref(x, w, 1e-6)
    out = nr.rms_norm(x, w, 1e-6, backend="triton")
    _close(out, ref, dtype, device)
    out3 = nr.rms_norm(x.reshape(rows, 1, n), w, 1e-6, backend="triton")
    assert out3.shape == (rows, 1, n)
    _close(out3.view(rows, n), ref, dtype, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype,T,H,D", [(torch.bfloat16, 13, 5, 128), (torch.float32, 7, 3, 64),
                                         (torch.bfloat16, 1, 2, 48), (torch.float16, 9, 3, 80)])
def test_norm_rope_kernel_matches_ref(dtype, T, H, D, norm, device):
    gen = _gen(2)
    hkv = 2
    width = (H + 2 * hkv) * D                               # a fused qkv output row
    qkv = (torch.randn(T, width, generator=gen) * 2).to(dtype).to(device)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + hkv) * D].view(T, hkv, D)
    # Tables with unequal halves (a real rotary table repeats its first half): a kernel reading the wrong half fails.
    cos = (torch.rand(T, D, generator=gen) * 2 - 1).to(dtype).to(device)
    sin = (torch.rand(T, D, generator=gen) * 2 - 1).to(dtype).to(device)
    w = (torch.rand(D, generator=gen) + 0.5).to(dtype).to(device) if norm else None
    for x in (q, k):
        ref = nr.norm_rope_ref(x, w, 1e-6, cos, sin)
        out = nr.norm_rope(x, w, 1e-6, cos, sin, backend="triton")
        assert out.is_contiguous()
        # On the H200 24-27% of the kernel's rotary results differed from the reference's by one last bit, as if
        # the products were not rounded before the sum (where x * cos and rotate_half(x) * sin nearly cancel, that
        # is many bits of the sum), so the bound is one last bit of the products' magnitude, not of the result's.
        xn = (nr.rms_norm_ref(x, w, 1e-6) if w is not None else x).float()
        mag = xn.abs() * cos.float().abs()[:, None] + xn.abs().roll(D // 2, -1) * sin.float().abs()[:, None]
        _close(out, ref, dtype, device, mag)


def test_backends_and_errors():
    x = torch.randn(3, 4, 8)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    # On the CPU 'auto' is the reference (no kernel launches).
    assert torch.equal(nr.norm_rope(x, None, 1e-6, cos, sin), nr.norm_rope_ref(x, None, 1e-6, cos, sin))
    assert torch.equal(nr.norm_rope(x, None, 1e-6, cos, sin), x)   # cos 1, sin 0: the identity
    w = torch.ones(8)
    assert torch.equal(nr.rms_norm(x, w, 1e-6), nr.rms_norm_ref(x, w, 1e-6))
    with pytest.raises(ValueError, match="unknown backend"):
        nr.rms_norm(x, w, 1e-6, backend="cuda")
    with pytest.raises(ValueError, match="even D"):
        nr.norm_rope(torch.randn(2, 2, 7), None, 1e-6, torch.ones(2, 7), torch.zeros(2, 7), backend="triton")


def _forward(model, ids, device):
    from oasiskv_runtime.ops.attend import attend_ref, causal_allowed

    class Causal:
        allowed = causal_allowed(len(ids), len(ids), device)

        def forward(self, layer_idx, q, k, v):
            return attend_ref(q, k, v, model.config.head_dim ** -0.5, self.allowed)

    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), Causal())
        return model.compute_logits(hidden).float()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_model_switch_is_the_reference_on_cpu(tmp_path, arch):
    """On the CPU the switch changes nothing (the composition runs either way), bit for bit."""
    from oasiskv_runtime.models.loader import load_model
    from tests.tiny_models import write_tiny

    model = load_model(str(write_tiny(tmp_path, arch)), "cpu", "float32")[0]
    ids = list(range(3, 40))
    model.use_fused_kernels(False)
    a = _forward(model, ids, "cpu")
    model.use_fused_kernels(True)
    assert all(m.fused for m in model.modules() if hasattr(m, "fused"))
    assert torch.equal(a, _forward(model, ids, "cpu"))


def test_engine_option_routes():
    from oasiskv_runtime.config import EngineConfig

    cfg = EngineConfig.from_overrides("x", fused_norm_rope=False)
    assert cfg.kernels.fused_norm_rope is False and EngineConfig("x").kernels.fused_norm_rope is True


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_model_matches_composition_on_cuda(tmp_path, arch):
    """The model's logits with the fused kernels against the PyTorch composition on CUDA (bfloat16: within the
    last bits), and the engine's greedy tokens with either setting (float32, graphs on): the same."""
    from oasiskv_runtime import LLM, SamplingParams
    from oasiskv_runtime.models.loader import load_model
    from tests.tiny_models import write_tiny

    path = str(write_tiny(tmp_path, arch, head_dim=64))
    model = load_model(path, "cuda", "bfloat16")[0]
    ids = list(range(3, 200, 3))
    model.use_fused_kernels(False)
    ref = _forward(model, ids, "cuda")
    model.use_fused_kernels(True)
    out = _forward(model, ids, "cuda")
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.95
    prompts = [[5, 17, 33, 9, 101, 250, 7] * 9, list(range(40, 40 + 77))]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = []
    for fused in (True, False):
        for mode in ("dense", "oasiskv"):
            llm = LLM(path, device="cuda", dtype="float32", mode=mode, top_k_blocks=64, host_kv_bytes=1 << 28,
                      fused_norm_rope=fused)
            runs.append([o.token_ids for o in llm.generate(prompts, greedy)])
    assert runs[0] == runs[1] == runs[2] == runs[3]
