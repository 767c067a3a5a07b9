"""Test setup: without CUDA, Triton kernels run in its CPU interpreter; `gpu` tests are skipped. The fused attention
is not autotuned in tests (FLM_ATTENTION_AUTOTUNE=0)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton kernels
# on a GPU each new attention key compiles its first candidate config instead of timing them all (one compile per
# key, not two to four): the suite launches many keys once each; test_triton_jvp_gpu.py checks every candidate
os.environ.setdefault("FLM_ATTENTION_AUTOTUNE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
