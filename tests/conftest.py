"""Shared pytest configuration. Markers: `gpu` tests need CUDA and run on the GPU machine only."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (runs on the GPU machine, skipped elsewhere)")
    config.addinivalue_line("markers", "slow: multi-process or end-to-end test (seconds to minutes)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run tests/gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
