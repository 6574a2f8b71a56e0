"""The benchmarks' hold on a VM's free page reporting: held, restored, and harmless where absent."""

import json
import os
import signal
import subprocess
import sys

import pytest

from benchmarks._guest_memory import hold_page_reporting


def _fake_params(tmp_path, order="9", reported="100"):
    params = tmp_path / "parameters"
    params.mkdir()
    (params / "page_reporting_order").write_text(order + "\n")
    (params / "reported_kib").write_text(reported + "\n")
    return params


def test_hold_raises_the_order_inside_and_restores_it_after(tmp_path):
    params = _fake_params(tmp_path)
    with hold_page_reporting(params=params, record=tmp_path / "hold.json") as info:
        assert (params / "page_reporting_order").read_text().strip() == "11"
        (params / "reported_kib").write_text("612\n")  # the guest handed 512 KiB back meanwhile
    assert (params / "page_reporting_order").read_text().strip() == "9"
    assert info == {"state": "held", "order_before": 9, "reported_kib_during": 512}


def test_restored_even_when_the_block_raises(tmp_path):
    params = _fake_params(tmp_path, order="7")
    try:
        with hold_page_reporting(params=params, record=tmp_path / "hold.json"):
            raise RuntimeError("benchmark failed")
    except RuntimeError:
        pass
    assert (params / "page_reporting_order").read_text().strip() == "7"


def test_missing_knob_or_opt_out_changes_nothing(tmp_path):
    with hold_page_reporting(params=tmp_path / "absent", record=tmp_path / "hold.json") as info:
        pass
    assert info["state"].startswith("not held: no free page reporting")
    params = _fake_params(tmp_path)
    with hold_page_reporting(False, params=params, record=tmp_path / "hold.json") as info:
        assert (params / "page_reporting_order").read_text().strip() == "9"
    assert info["state"] == "not held: --leave-page-reporting"


def test_unwritable_knob_is_reported_not_raised(tmp_path):
    params = tmp_path / "parameters"
    (params / "page_reporting_order").mkdir(parents=True)  # reading or writing it fails with OSError
    with hold_page_reporting(params=params, record=tmp_path / "hold.json") as info:
        pass
    assert info["state"].startswith("not held: ")


def test_describe_hold_says_what_was_done():
    from benchmarks._guest_memory import describe_hold

    line = describe_hold({"state": "held", "order_before": 9, "reported_kib_during": 2048})
    assert line.startswith("held (page_reporting_order 9 -> 11, restored at the end); 2 MiB handed")
    assert describe_hold(None) == "not recorded"
    assert describe_hold({"state": "not held: --leave-page-reporting"}).startswith("not held")


def test_a_second_hold_leaves_the_first_ones_value_alone(tmp_path):
    params = _fake_params(tmp_path)
    with hold_page_reporting(params=params, record=tmp_path / "hold.json"):
        with hold_page_reporting(params=params, record=tmp_path / "hold.json") as inner:
            pass
        assert inner["state"] == "held (already, by another run)"
        assert (params / "page_reporting_order").read_text().strip() == "11"
    assert (params / "page_reporting_order").read_text().strip() == "9"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_inside_the_hold_still_restores(tmp_path, signum):
    params = _fake_params(tmp_path)
    before = signal.getsignal(signum)
    with pytest.raises(SystemExit):
        with hold_page_reporting(params=params, record=tmp_path / "hold.json"):
            os.kill(os.getpid(), signum)  # the handler raises at the next bytecode
            for _ in range(1000):
                pass
    assert (params / "page_reporting_order").read_text().strip() == "9"
    assert signal.getsignal(signum) is before
    assert not (tmp_path / "hold.json").exists()


def test_a_hold_left_by_a_killed_run_is_repaired_by_the_next_one(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs, as after SIGKILL
    params = _fake_params(tmp_path, order="11")
    record = tmp_path / "hold.json"
    record.write_text(json.dumps({"pid": dead.pid, "order": "9"}))
    with hold_page_reporting(params=params, record=record) as info:
        assert info["state"] == "held" and info["recovered_from_dead_run"]
        assert json.loads(record.read_text())["pid"] == os.getpid()
    assert (params / "page_reporting_order").read_text().strip() == "9"
