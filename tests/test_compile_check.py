"""``snack compile-check``: every Triton kernel compiles for sm_80 and sm_90 without a GPU."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="compile-check needs Triton")

from snack.backends.triton import compile_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(\S+)\s+(float32|float16|bfloat16)\s+sm_(\d+)\s+ok\s+(\d+) bytes$")


def test_every_kernel_compiles_for_both_architectures():
    # A fresh process: the interpreter flag another test module may have set must not reach it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "snack.cli", "compile-check", "--arch", "80", "--arch", "90"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [m.groups() for m in map(LINE.match, result.stdout.splitlines()) if m]
    kernels = {name for name, _, _, _ in lines}
    assert kernels == {variant for variant, _, _ in compile_check._VARIANTS}
    assert len(lines) == len(kernels) * 3 * 2  # every dtype and arch
    assert all(int(size) > 0 for *_, size in lines)


def test_failure_is_reported_and_exits_nonzero(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def broken(variant, dtype, arch):
        raise RuntimeError("ptxas exploded")

    monkeypatch.setattr(compile_check, "compile_kernel", broken)
    assert compile_check.run(argparse.Namespace(arch=[90], dtype=["float32"])) == 1
    out = capsys.readouterr().out
    assert "sddmm" in out and "FAILED" in out and "ptxas exploded" in out


@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_refuses_to_run_under_the_interpreter(value, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", value)  # any value Triton reads as true
    assert compile_check.run(argparse.Namespace(arch=None, dtype=None)) == 1
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err


def test_an_architecture_or_dtype_given_twice_compiles_once(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled = []
    monkeypatch.setattr(compile_check, "compile_kernel", lambda *key: compiled.append(key) or _FakeKernel())
    assert compile_check.run(argparse.Namespace(arch=[90, 90], dtype=["float32", "float32"])) == 0
    assert len(compiled) == len(set(compiled)) == len(compile_check._VARIANTS)
    assert f"{len(compiled)}/{len(compiled)} kernels compiled" in capsys.readouterr().out


class _FakeKernel:
    asm = {"cubin": b"1234"}


@pytest.mark.parametrize("arch", ["9", "0", "999", "-5", "50", "8.0", "sm_90"])
def test_unsupported_architectures_are_refused_before_compiling(arch, capsys):
    """LLVM aborts the whole process on some (sm_9), ptxas rejects others (sm_50)."""
    parser = argparse.ArgumentParser()
    compile_check.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--arch", arch])
    expected = f"must be a compute capability of 75, 80, 86, 87, 89, 90, 100, 103, 120; got '{arch}'"
    assert expected in capsys.readouterr().err
