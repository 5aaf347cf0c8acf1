"""moe_ep.runs.preemption: signals recorded, not acted on; the ranks' one-collective agreement on
whether to stop, after the same step on every rank; the handlers chained and restored; bad
arguments named. The launched runs of the examples under SIGTERM are in tests/faults/."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from dist_utils import run_ranks
from moe_ep.runs.preemption import PREEMPTED_EXIT_STATUS, Preempted, Preemption, parse_signal


@pytest.fixture(autouse=True)
def handlers_restored():
    """The tests signal this process: every handler they may change is put back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("given, expected", [
    ("SIGTERM", signal.SIGTERM), ("usr1", signal.SIGUSR1), ("SigUsr2", signal.SIGUSR2),
    (str(int(signal.SIGUSR1)), signal.SIGUSR1), (int(signal.SIGHUP), signal.SIGHUP), (signal.SIGINT, signal.SIGINT),
])
def test_signals_are_read_by_name_or_number(given, expected):
    assert parse_signal(given) is expected


@pytest.mark.parametrize("given, words", [
    ("SIGNOPE", "no such signal: 'SIGNOPE'"), ("", "no such signal: ''"), ("-15", "no such signal: '-15'"),
    ("999", "no such signal: '999'"), ("SIGKILL", "SIGKILL cannot be caught"), ("stop", "SIGSTOP cannot be caught"),
    ("CHLD", "SIGCHLD is sent for routine events"), (int(signal.SIGWINCH), "SIGWINCH is sent for routine events"),
    ("SIGSEGV", "SIGSEGV reports a fault"), ("abrt", "SIGABRT reports a fault"),
])
def test_signals_that_do_not_exist_cannot_be_caught_or_mean_something_else_are_refused(given, words):
    with pytest.raises(ValueError, match=words):
        parse_signal(given)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"signals": ()}, ValueError, "signals must name at least one signal"),
    ({"signals": "SIGTERM"}, TypeError, "signals must be a collection of signals, got 'SIGTERM'"),
    ({"signals": (signal.SIGKILL,)}, ValueError, "signals: SIGKILL cannot be caught"),
    ({"every": 0}, ValueError, "every must be an int >= 1"),
    ({"every": True}, ValueError, "every must be an int >= 1"),
    ({"every": 2.0}, ValueError, "every must be an int >= 1"),
])
def test_bad_arguments_are_named(kwargs, error, words):
    with pytest.raises(error, match=words):
        Preemption(**kwargs)


def test_exit_status_is_ex_tempfail_and_not_a_killed_process():
    assert PREEMPTED_EXIT_STATUS == 75
    assert PREEMPTED_EXIT_STATUS not in (0, 1, 2, 130) and PREEMPTED_EXIT_STATUS < 128


def test_the_message_says_signal_step_checkpoint_and_how_to_resume():
    assert str(Preempted(signal.SIGUSR1, 7, "/runs/a/checkpoints/step_00000007")) == (
        "preempted (SIGUSR1) after step 7: /runs/a/checkpoints/step_00000007 written; run the same command to resume")


def test_a_signal_is_recorded_and_the_step_boundary_says_stop():
    """One process: the signal interrupts nothing; the next boundary stops, and keeps saying so."""
    with Preemption(signals=("SIGUSR1", signal.SIGTERM)) as preemption:
        assert not preemption.stop_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.received is signal.SIGUSR1 and preemption.signal is None
        assert preemption.stop_requested() and preemption.signal is signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: recorded as nothing new, the process lives
        assert preemption.received is signal.SIGUSR1 and preemption.stop_requested()
    # On its way out after the stop: a launcher's late SIGTERM must not turn the exit into a kill.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN


def test_previous_handlers_are_chained_and_restored_when_no_stop_was_agreed():
    calls = []

    def users_handler(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGUSR1, users_handler)
    sigint_before = signal.getsignal(signal.SIGINT)
    with Preemption(signals=(signal.SIGUSR1, signal.SIGINT)) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        # Python's default SIGINT handler raises KeyboardInterrupt: replaced, not chained.
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.received is signal.SIGUSR1
    assert calls == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is users_handler
    assert signal.getsignal(signal.SIGINT) is sigint_before


def test_a_handler_installed_after_ours_is_left_in_place():
    with Preemption(signals=(signal.SIGUSR2,)):
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_only_the_main_thread_can_install_handlers():
    errors = []

    def enter():
        try:
            with Preemption():
                pass
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert errors == ["Preemption must be entered in the main thread: Python runs signal handlers only there"]


def test_every_n_checks_only_on_every_nth_call():
    with Preemption(signals=(signal.SIGUSR1,), every=3) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert [preemption.stop_requested() for _ in range(3)] == [False, False, True]


def _stop_step(rank, world_size, signals_by_rank, every):
    """Ten step boundaries; at boundary ``at`` a rank sends itself its signal. Returns the boundary
    each rank stopped at, the agreed signal, what this rank received, and how many all-reduces
    ran."""
    import torch.distributed as dist

    reductions = []
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        reductions.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        with Preemption(signals=(signal.SIGTERM, signal.SIGUSR1), every=every) as preemption:
            for boundary in range(10):
                sent = signals_by_rank.get(rank)
                if sent is not None and sent[0] == boundary:
                    os.kill(os.getpid(), sent[1])
                if preemption.stop_requested():
                    break
    finally:
        dist.all_reduce = all_reduce
    return boundary, preemption.signal, preemption.received, len(reductions)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step():
    """SIGUSR1 to rank 1 alone at boundary 3: both ranks stop there, both told SIGUSR1, after one
    all-reduce per boundary; with every=4 both stop at boundary 3 too (the 4th call); signals to
    both ranks at different boundaries stop both at the first."""
    outcomes = run_ranks(_stop_step, 2, {1: (3, signal.SIGUSR1)}, 1, timeout=120)
    assert outcomes == [(3, signal.SIGUSR1, None, 4), (3, signal.SIGUSR1, signal.SIGUSR1, 4)]
    outcomes = run_ranks(_stop_step, 2, {1: (1, signal.SIGUSR1)}, 4, timeout=120)
    assert outcomes == [(3, signal.SIGUSR1, None, 1), (3, signal.SIGUSR1, signal.SIGUSR1, 1)]
    outcomes = run_ranks(_stop_step, 2, {0: (5, signal.SIGTERM), 1: (2, signal.SIGUSR1)}, 1, timeout=120)
    assert [o[:2] for o in outcomes] == [(2, signal.SIGUSR1)] * 2


def test_run_reported_says_a_preemption_once_and_exits_with_its_status(capsys, monkeypatch):
    from moe_ep.runs import run_reported

    def preempted_run(args):
        raise Preempted(signal.SIGTERM, 3, "/runs/a/checkpoint-3")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run_reported(preempted_run, None) == PREEMPTED_EXIT_STATUS
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert run_reported(preempted_run, None) == PREEMPTED_EXIT_STATUS
    assert capsys.readouterr().err == (
        "preempted (SIGTERM) after step 3: /runs/a/checkpoint-3 written; run the same command to resume\n")

