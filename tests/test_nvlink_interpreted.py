"""The NVLink low-latency kernels on CPU tensors, under Triton's interpreter (no GPU needed): several ranks in
one process, their areas mapped to each other by address, results bit for bit against the independent model
(tests/interpreted_low_latency.py). The interpreter runs every program in turn, so this checks the kernels'
logic (protocol counters, masks, tables, routes, row order, the FP8 cast and scales, the combine's sum), not
their memory ordering or speed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _version(text: str):
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


# (Triton 3.6's interpreter hands loop bounds over as arrays, which recent numpy will not turn into ints)
@pytest.mark.skipif(_version(triton.__version__) < (3, 7), reason="needs Triton >= 3.7's interpreter")
def test_low_latency_kernels_match_the_model_under_the_interpreter():
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(tests / "interpreted_low_latency.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), \
        (done.stdout[-3000:] + done.stderr[-3000:])
