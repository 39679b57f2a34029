import pytest


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Nothing may be fetched from a model hub in tests; libraries must use local files only.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _reset_accelerate_state():
    # accelerate keeps one mixed precision per process and has no public reset; its own test case class
    # (accelerate.test_utils.testing.AccelerateTestCase) clears the state this way between tests. The process
    # group and device (PartialState) are kept.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts with accelerate's process-wide state cleared, as a new process would (a test may train
    with another precision than the one before it); the fixture's value clears it again within a test."""
    _reset_accelerate_state()
    return _reset_accelerate_state


@pytest.fixture(autouse=True, scope="module")
def fresh_accelerate_state_per_module():
    """The same for a module's own fixtures, which are set up before the per-test reset (a module fixture that
    trains in fp32 after a test that trained in bf16)."""
    _reset_accelerate_state()
