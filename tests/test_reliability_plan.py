"""``jaxdit plan`` with bad numbers: each is refused with one line naming the flag (exit code 2), where
before a 0 was read as "unset" (the default used instead), NaN passed the positivity checks, and a device
count with many divisors enumerated divisors ** 6 tuples (a hang)."""

from __future__ import annotations

import re

import pytest

from jaxdit.cli import main


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--height", "0"], "positive multiples of 16; got 0x1024"),  # was the preset's 1024
        (["--steps", "0"], "steps must be >= 1, got 0"),  # was the preset's 28
        (["--requests", "0"], "requests must be >= 1, got 0"),  # was "bad workload: tokens=..."
        (["--memory-gb", "0"], r"memory \(0.0 GB\) must be positive"),  # was 80
        (["--memory-gb", "nan"], r"memory \(nan GB\) must be positive"),
        (["--tflops", "0"], r"tflops \(0.0\)"),  # was 450
        (["--bandwidth", "nan"], r"bandwidth \(nan GB/s\)"),  # was "min() arg is an empty sequence"
        (["--attention_tflops", "nan"], "attention_tflops must be positive, got nan"),
        (["--devices", "100000"], r"devices must be in 1\.\.4096, got 100000"),  # was a hang
    ],
)
def test_plan_refuses_bad_numbers(flags, message, capsys):
    argv = ["plan", "--model", "flux-dev", "--devices", "8", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
