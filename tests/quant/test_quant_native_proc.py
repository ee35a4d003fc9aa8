"""The native ``fake_quantize`` kernels (``fp8rl.quant.native``) against the PyTorch code they
replace: the same bits and the same strides on every path, that they ran, their errors, and
what happens without them (no compiler, ``FP8RL_NATIVE=0``).

The reference is ``fake_quantize`` with the kernels off (its PyTorch fast paths, themselves
tested against the tensor path and ``dequantize(quantize(...))`` in
``test_quant_quantize.py``) and the tensor path ``_fake_quantize_tensor`` itself; whole runs
are covered by the golden numbers (``tests/mini/test_mini_golden_proc.py``), which also check that
an FP8 cell called the kernels.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from fp8rl.quant import (
    E4M3,
    E5M2,
    MX,
    NonFiniteError,
    PerBlock,
    PerRow,
    PerTensor,
    fake_quantize,
    native,
)

fake = importlib.import_module("fp8rl.quant.fake")

GRANS = {"tensor": PerTensor(), "row": PerRow(), "block1x128": PerBlock(1, 128),
         "block128x128": PerBlock(128, 128), "mx32": MX(32)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _pytorch_code(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(native, "enabled", lambda: False)


def _calls() -> int:
    return sum(native.calls.values())


def _reference(x, g, fmt, pow2, divide):
    with pytest.MonkeyPatch.context() as mp:
        _pytorch_code(mp)
        return fake_quantize(x, g, fmt, pow2_scale=pow2, divide=divide)


def _operand(shape, dtype, seed):
    """Rows scaled from 1e-30 to 1e20 (BF16 keeps float32's range), a zero row, signed zeros, a
    subnormal."""
    gen = torch.Generator().manual_seed(seed)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    x = torch.randn(rows, shape[-1], generator=gen) * torch.logspace(-30, 20, rows)[:, None]
    x[0] = 0.0
    if rows > 1:
        x[1, : min(3, shape[-1])] = torch.tensor([0.0, -0.0, -1e-40])[: min(3, shape[-1])]
    return x.to(dtype).reshape(shape)


def _off_on_purpose() -> bool:
    return os.environ.get("FP8RL_NATIVE") == "0"


def test_the_kernels_are_built_on_this_machine():
    """The mini runs expect them: a machine without a C compiler falls back (the same floats,
    slower), which this test makes visible: a skip saying why, and a failure under CI
    (``FP8RL_REQUIRE_NATIVE=1``, set by ``.ci/run``), whose machines have a compiler."""
    if _off_on_purpose():
        pytest.skip("FP8RL_NATIVE=0: the kernels are off on purpose")
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip(f"the kernels are built for x86-64 Linux only; this is {sys.platform} {os.uname().machine}")
    if not native.enabled() and os.environ.get("FP8RL_REQUIRE_NATIVE") != "1":
        pytest.skip(f"the native kernels are {native.status()}: the PyTorch code computes the same floats, "
                    "slower; install a C compiler (cc) to build and check them")
    assert native.enabled(), native.status()
    assert native.status() == "on"


@pytest.mark.parametrize("gname", list(GRANS))
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("divide", [False, True], ids=["mul", "div"])
@pytest.mark.parametrize("pow2", [False, True], ids=["", "pow2"])
def test_same_bits_and_strides_as_the_pytorch_code(gname, fmt, dtype, divide, pow2):
    """Row-major operands (2-D, N-D, ragged widths, one column, one row) and transposes of
    row-major ones (blocks that tile the rows, ragged ones, one scale): the bits and strides of
    ``fake_quantize`` with the kernels off, the kernels called each time."""
    g = GRANS[gname]
    shapes = [(40, 128), (33, 200), (130, 200), (7, 1), (1, 20), (300, 64), (6, 5, 256)]
    for i, shape in enumerate(shapes):
        x = _operand(shape, dtype, i)
        operands = [x] if len(shape) != 2 else [x, _operand(shape[::-1], dtype, 50 + i).t()]
        for xx in operands:
            if isinstance(g, PerBlock) and g.rows > 1 and xx.ndim != 2:
                continue
            n = _calls()
            out = fake_quantize(xx, g, fmt, pow2_scale=pow2, divide=divide)
            ref = _reference(xx, g, fmt, pow2, divide)
            where = (tuple(xx.shape), xx.stride())
            assert torch.equal(_bits(out), _bits(ref)), where
            assert out.stride() == ref.stride(), (where, out.stride(), ref.stride())
            row_major = xx.is_contiguous()
            takes = native.enabled() and (row_major or isinstance(g, PerTensor) or g.block_shape(*xx.shape)[0] == 1)
            assert _calls() > n if takes else _calls() == n, where


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("gname", ["tensor", "row"])
def test_every_finite_bfloat16_value(fmt, gname):
    """All 65,280 finite BF16 bit patterns (signed zeros and subnormals included), 255 per row,
    against the tensor path: one scale for all, and a scale per row."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)].reshape(-1, 255)
    for divide in (False, True):
        out = fake_quantize(x, GRANS[gname], fmt, divide=divide)
        ref = fake._fake_quantize_tensor(x, GRANS[gname], fmt, False, divide)
        assert torch.equal(_bits(out), _bits(ref))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("gname", ["tensor", "row", "block128x128", "mx32"])
def test_non_finite_input_raises_with_its_index(bad, gname):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(6, 64, dtype=dtype)
        x[4, 9] = bad
        for xx in (x, x.t().contiguous().t()):
            n = _calls()
            with pytest.raises(NonFiniteError, match=r"non-finite value \((-?inf|nan)\) at index \(4, 9\)"):
                fake_quantize(xx, GRANS[gname], E4M3)
            assert _calls() > n or not xx.is_contiguous() or not native.enabled()


def test_other_dtypes_and_devices_keep_the_pytorch_code():
    """float16 and float64 operands (and anything not on the CPU) are not the kernels'."""
    for dtype in (torch.float16, torch.float64):
        x = torch.randn(16, 64, dtype=dtype)
        n = _calls()
        out = fake_quantize(x, PerRow(), E4M3)
        assert _calls() == n
        assert torch.equal(_bits(out), _bits(_reference(x, PerRow(), E4M3, False, False)))
    assert not native.supports(torch.randn(4, 4, dtype=torch.float16))
    assert not native.supports(torch.randn(4, 4).t())


def _child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


_CHILD = """
import torch
from fp8rl.quant import fake_quantize, PerRow, native
x = torch.randn(64, 80, generator=torch.Generator().manual_seed(1)).bfloat16()
out = fake_quantize(x, PerRow())
print(native.status())
print(sum(native.calls.values()))
torch.save(out, {path!r})
"""


def test_without_the_kernels_the_same_floats(tmp_path):
    """``FP8RL_NATIVE=0`` and a compiler that fails (an empty cache, ``CC=false``): the
    status says why, nothing is called, and the result is the kernels' bit for bit."""
    if not _off_on_purpose() and not native.enabled():
        pytest.skip(f"the native kernels are {native.status()} here: nothing to compare the fallback with")
    runs = {"on": {"FP8RL_NATIVE": "1"}, "off": {"FP8RL_NATIVE": "0"},
            "no compiler": {"CC": "false", "FP8RL_NATIVE": "1", "FP8RL_NATIVE_CACHE": str(tmp_path / "empty")}}
    outs = {}
    for name, env in runs.items():
        path = tmp_path / f"{name}.pt"
        proc = _child(_CHILD.format(path=str(path)), env)
        assert proc.returncode == 0, proc.stderr
        status, calls = proc.stdout.split("\n")[:2]
        outs[name] = torch.load(path)
        if name == "on" and status != "on" and os.environ.get("FP8RL_REQUIRE_NATIVE") != "1":
            pytest.skip(f"the native kernels are {status} here: nothing to compare the fallback with")
        if name == "on":
            assert status == "on" and int(calls) > 0
        else:
            assert status.startswith("off (") and int(calls) == 0, status
    assert "FP8RL_NATIVE=0" in _child(_CHILD.format(path=str(tmp_path / "x.pt")), runs["off"]).stdout
    assert "could not build with 'false'" in _child(_CHILD.format(path=str(tmp_path / "y.pt")),
                                                    runs["no compiler"]).stdout
    assert not (tmp_path / "empty").exists() or not list((tmp_path / "empty").glob("*.so"))
    assert torch.equal(_bits(outs["on"]), _bits(outs["off"]))
    assert torch.equal(_bits(outs["on"]), _bits(outs["no compiler"]))


def test_the_library_is_built_once_and_reused(tmp_path, monkeypatch):
    """A second build with the same source, compiler and flags reuses the cached library (the
    compiler is asked its ``--version`` for the key, and compiles nothing)."""
    if not native.enabled() and not _off_on_purpose():
        pytest.skip(f"the native kernels are {native.status()}")
    monkeypatch.setenv("FP8RL_NATIVE_CACHE", str(tmp_path))
    cc = os.environ.get("CC") or "cc"
    first = native._build(cc)
    stamp = first.stat().st_mtime_ns
    assert native._build(cc) == first and first.stat().st_mtime_ns == stamp
    real_run = native.subprocess.run

    def run(args, *a, **k):
        if "--version" not in args:
            pytest.fail(f"compiled again: {args}")
        return real_run(args, *a, **k)

    monkeypatch.setattr(native.subprocess, "run", run)
    assert native._build(cc) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_disabled_runs_the_pytorch_code_inside_the_block():
    if not native.enabled():
        pytest.skip(f"the native kernels are {native.status()}")
    x = _operand((64, 80), torch.bfloat16, 7)
    n = _calls()
    out = fake_quantize(x, PerRow(), E4M3)
    assert _calls() == n + 1
    with native.disabled():
        with native.disabled():
            assert not native.enabled()
        assert not native.enabled()
        ref = fake_quantize(x, PerRow(), E4M3)
    assert _calls() == n + 1
    assert native.enabled()
    assert torch.equal(_bits(out), _bits(ref))


def test_the_cache_key_names_source_compiler_flags_and_platform(tmp_path, monkeypatch):
    """Another compiler version (the same ``cc`` name) builds its own library; so does another
    source text. A wrapper ``cc`` that reports another ``--version`` and compiles with the real one
    gets a second file in the cache."""
    if not native.enabled() and not _off_on_purpose():
        pytest.skip(f"the native kernels are {native.status()}")
    src = native.SOURCE.read_text()
    assert native.cache_key(src, "cc", "gcc 12.2.0") != native.cache_key(src, "cc", "gcc 13.1.0")
    assert native.cache_key(src, "cc", "gcc 12.2.0") != native.cache_key(src + "\n", "cc", "gcc 12.2.0")
    assert native.cache_key(src, "cc", "x") == native.cache_key(src, "cc", "x")
    cc = os.environ.get("CC") or "cc"
    wrapper = tmp_path / "cc-other"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "other-cc 9.9"; exit 0; fi\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("FP8RL_NATIVE_CACHE", str(tmp_path / "cache"))
    a, b = native._build(cc), native._build(str(wrapper))
    assert a != b and sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([a.name, b.name])
    assert native.compiler_identity(str(wrapper)) == "other-cc 9.9"
    with pytest.raises(OSError, match="--version failed"):
        native.compiler_identity(str(tmp_path / "no-such-cc"))


def test_every_tensor_is_checked_before_its_pointer_is_passed():
    """A wrong operand, block or scale tensor raises before the C code reads it."""
    if not native.enabled():
        pytest.skip(f"the native kernels are {native.status()}")
    x = torch.randn(8, 64)
    q = torch.ones(8, 2)
    for bad, why in ((x.t(), "row-major"), (x.double(), "row-major"), (x.reshape(2, 4, 64), "row-major")):
        with pytest.raises(ValueError, match=why):
            native.block_amax(bad, 1, 32)
        with pytest.raises(ValueError, match=why):
            native.full(bad, 1, 32, E4M3, False, 1e-12)
    with pytest.raises(ValueError, match="at least 1 x 1"):
        native.block_amax(x, 0, 32)
    for bad_q in (q[:, :1], q.double(), torch.ones(2, 8).t(), torch.ones(4)):
        with pytest.raises(ValueError, match="qscale must be a contiguous float32 CPU tensor of 16 block values"):
            native.apply(x, 1, 32, bad_q, q, False, E4M3)
    with pytest.raises(ValueError, match="dq must be"):
        native.apply(x, 1, 32, q, q[:4], False, E4M3)
    assert native.apply(x, 1, 32, q, q, False, E4M3).shape == (8, 64)  # the good call runs
