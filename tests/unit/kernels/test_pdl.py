"""kernels.triton.pdl: programmatic dependent launch is asked for only where the device has it."""

import pytest
import torch

from kernels.triton import pdl


def test_off_the_gpu_no_kernel_waits_and_no_launch_asks_for_pdl():
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def test_the_environment_switch_turns_it_off_on_any_device(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before the device is queried
