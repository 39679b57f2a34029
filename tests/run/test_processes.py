"""The processes sharing a run (mmcl/run/processes.py), as one process sees them: agreement returns the result or
raises the error itself, and a collective that failed because another process is gone is told apart, in words."""

import pytest
from accelerate import Accelerator

from mmcl.errors import DataError
from mmcl.run import processes


@pytest.fixture
def one(cpu_device):
    return Accelerator(cpu=True)


def test_with_one_process_agreement_any_process_broadcast_and_waiting_are_the_values_themselves(one):
    assert one.num_processes == 1
    assert processes.agreed(one, lambda: 42) == 42
    with pytest.raises(DataError, match="bad shard") as info:
        processes.agreed(one, lambda: (_ for _ in ()).throw(DataError("bad shard")))
    assert not getattr(info.value, "everywhere", False)
    with pytest.raises(ZeroDivisionError):  # a bug keeps its own type and traceback
        processes.agreed(one, lambda: 1 / 0)
    assert processes.any_process(one, True) is True and processes.any_process(one, False) is False
    value = {"a": [1, 2]}
    assert processes.broadcast_from_main(one, value) is value
    ran = []
    with processes.others_wait(one, 1.0):
        ran.append(1)
    assert ran == [1]


@pytest.mark.parametrize("message,description,timeout", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:47234: Connection reset by peer. "
     "This is typically caused by a crash", "Read error [127.0.0.1]:47234: Connection reset by peer", False),
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete",
     "Timed out waiting 1800000ms for recv operation to complete", True),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600010 "
     "milliseconds before timing out.\nmore", "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
     "OpType=ALLREDUCE) ran for 600010 milliseconds before timing out.", True),
])
def test_a_collective_that_lost_its_peer_is_described_in_one_line(message, description, timeout):
    got = processes.lost_peer(RuntimeError(message))
    assert got == description
    assert processes.timed_out(got) is timeout


def test_other_errors_are_no_lost_peer():
    assert processes.lost_peer(RuntimeError("CUDA out of memory")) is None
    assert processes.lost_peer(ValueError("bad value")) is None
