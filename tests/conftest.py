import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "POSLAB_CACHE" not in os.environ:  # data a test prepares without a cache_dir stays out of the user's cache
    os.environ["POSLAB_CACHE"] = tempfile.mkdtemp(prefix="poslab-tests-")
    atexit.register(shutil.rmtree, os.environ["POSLAB_CACHE"], True)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for the test (modules opt in with ``pytestmark``): tiny models gain nothing from a
    second thread, and under load its OpenMP spinning makes them several times slower. The 2-process training
    test also needs it set before it forks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the reliability record (tests/test_reliability_*.py; scripts/reliability_report.py renders it) ----------
# A test takes the `reliability` fixture and calls record(group, fault, cases, outcome) with what it measured;
# the record is appended, with the test's result (passed, failed, xfailed), to $POSLAB_RELIABILITY_RESULTS
# (JSON lines) when that is set, and dropped otherwise.

RELIABILITY_RESULTS = "POSLAB_RELIABILITY_RESULTS"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    setattr(item, f"_reliability_{report.when}", report)


class _ReliabilityRecorder:
    def __init__(self, test: str) -> None:
        self.test, self.records = test, []

    def record(self, group: str, fault: str, cases: int, outcome: str) -> None:
        assert isinstance(cases, int) and cases > 0, "a record counts the cases it actually ran"
        self.records.append({"group": group, "fault": fault, "cases": cases, "outcome": outcome})


@pytest.fixture
def reliability(request):
    import json
    import time

    recorder = _ReliabilityRecorder(request.node.nodeid)
    started = time.perf_counter()
    yield recorder
    path = os.environ.get(RELIABILITY_RESULTS)
    if not path:
        return
    call = getattr(request.node, "_reliability_call", None)
    result = "not run" if call is None else "xfailed" if hasattr(call, "wasxfail") and call.skipped else call.outcome
    seconds = round(time.perf_counter() - started, 2)
    lines = "".join(json.dumps({**r, "test": recorder.test, "result": result, "seconds": seconds}) + "\n"
                    for r in recorder.records)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())  # one append per test: pytest-xdist workers share the file
    finally:
        os.close(fd)
