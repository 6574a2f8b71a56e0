"""A parameter without optimizer state at the save resumes bitwise under DDP (issue 24, item 2)."""

import pytest

from tests.distributed import partial_optim
from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(240)


def _both_cases(rank, world_size, root, phase):
    fn = partial_optim.reference_and_save if phase == "save" else partial_optim.resume
    return {case: fn(rank, world_size, case, f"{root}/{case}") for case in ("late", "frozen")}


def test_ddp_parameter_without_optimizer_state_at_save_resumes_bitwise(tmp_path):
    # Two jobs (fresh processes): the reference + a save at step 3; the resume from it.
    reference = values(run_ranks(_both_cases, 2, str(tmp_path), "save", timeout_s=180))
    resumed = values(run_ranks(_both_cases, 2, str(tmp_path), "resume", timeout_s=180))
    for rank in range(2):
        for case in ("late", "frozen"):
            partial_optim.assert_resumed_bitwise(case, reference[rank][case], resumed[rank][case])
