"""NVLink kernels on CPU tensors, under Triton's interpreter (no GPU needed): bit for bit against independent
expectations, the low-latency kernels with several ranks in one process, their areas mapped to each other by
address (tests/interpreted_low_latency.py), and the normal-mode combine's reduction on rows laid out as its
senders leave them (tests/interpreted_combine.py); the rings' waits after an earlier timeout, which must
end within seconds, not the timeout (tests/interpreted_rings.py); and the direct protocol's kernels keeping
within outputs that hold fewer rows than arrive (tests/interpreted_direct.py); the normal mode's host code and
kernels end to end on one rank, against the reference transport (tests/interpreted_normal.py). The interpreter runs every
program in turn, so this checks the kernels' logic (protocol counters, masks, tables, routes, row order, the
FP8 cast and scales, the combines' sums, when waits give up), not their memory ordering or speed."""
from pathlib import Path

import pytest
from dist_utils import SUPPORTED_TRITON, release, run_script
from randomness import base_seed

triton = pytest.importorskip("triton", minversion=SUPPORTED_TRITON)


# (Triton 3.6's interpreter hands loop bounds over as arrays, which recent numpy will not turn into ints)
@pytest.mark.skipif(release(triton.__version__) < (3, 7), reason="needs Triton >= 3.7's interpreter")
@pytest.mark.parametrize("script", ["interpreted_low_latency.py", "interpreted_combine.py", "interpreted_rings.py",
                                    "interpreted_direct.py", "interpreted_normal.py"])
def test_kernels_match_under_the_interpreter(script):
    seed = base_seed()
    done = run_script(Path(__file__).resolve().parent / script, 900, TRITON_INTERPRET="1",
                      DEEP_EP_TEST_SEED=str(seed))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), \
        f"seed={seed} (replay with DEEP_EP_TEST_SEED={seed}):\n" + done.stdout[-3000:] + done.stderr[-3000:]
