"""deep_ep.roll_call on a real TCPStore, with ranks as threads of this process (each with its own store client):
the verdicts of shrink mode's host steps, a rank that is declared absent, cut off, or rejoins after sitting
cleans out."""
import datetime
import threading
import time
from typing import Callable, Dict, List

import pytest
import torch.distributed as dist

from deep_ep.roll_call import AbsentError, RollCall

TIMEOUT_S = 2.0   # (the delays below are 0.2 s: far inside it)


def run_ranks(programs: Dict[int, Callable[[RollCall], object]], num_ranks: int) -> Dict[int, object]:
    """Run programs[r](roll call of rank r) on threads; returns each one's result (or the exception it raised)."""
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    namespace = f"test/{time.monotonic_ns()}"
    results: Dict[int, object] = {}

    def body(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", master.port, None, False, timeout=datetime.timedelta(seconds=30))
        try:
            results[rank] = programs[rank](RollCall(store, namespace, rank, TIMEOUT_S))
        except Exception as error:  # noqa: BLE001 - returned to the test
            results[rank] = error
    threads = [threading.Thread(target=body, args=(rank,)) for rank in programs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    return results


def others(rank: int, num_ranks: int, also_not=()) -> List[int]:
    return [r for r in range(num_ranks) if r != rank and r not in also_not]


def test_everyone_arrives_and_a_late_rank_is_declared_absent():
    def punctual(call: RollCall):
        verdicts, gone = [], []
        for _ in range(3):   # (as the Buffer does: a rank declared absent is masked, and not waited for again)
            verdicts.append(call.step(others(call.rank, 3, gone)))
            gone += verdicts[-1]
        return verdicts

    def late(call: RollCall):
        time.sleep(TIMEOUT_S + 1.0)
        return call.step(others(call.rank, 3))

    results = run_ranks({0: punctual, 1: punctual, 2: late}, 3)
    # every rank that came reads the same verdict; the late one learns it was declared absent
    assert results[0] == results[1] == [[2], [], []], results
    assert isinstance(results[2], AbsentError), results


def test_a_rank_cut_off_right_after_a_step_is_not_declared_absent():
    """Rank 2 comes last to a step and at once takes its next step alone (the others masked it): its key of
    the first step must stay until the others have read it."""
    def waiting(call: RollCall):
        return call.step(others(call.rank, 3))

    def last_then_cut_off(call: RollCall):
        time.sleep(0.2)
        first = call.step(others(call.rank, 3))
        call.step([])
        return first

    results = run_ranks({0: waiting, 1: waiting, 2: last_then_cut_off}, 3)
    assert results == {0: [], 1: [], 2: []}, results


def test_a_rank_that_sat_a_clean_out_rejoins_at_the_next():
    """Ranks 0 and 1 clean with rank 2 masked, then unmask it and clean again; rank 2 calls one clean, before
    they start the first: it passes over the clean it missed and meets them at the second, steps in step."""
    def steady(call: RollCall):
        time.sleep(0.2)
        first = call.clean(others(call.rank, 3, (2,)), [2], 10 + call.rank)
        second = call.clean(others(call.rank, 3), [], 10 + call.rank)
        return first, second, call.step(others(call.rank, 3)), call._clean

    def rejoining(call: RollCall):
        return call.clean(others(call.rank, 3), [], 3), call.step(others(call.rank, 3)), call._clean

    results = run_ranks({0: steady, 1: steady, 2: rejoining}, 3)
    assert results[0] == (([], 11), ([], 11), [], 2), results
    assert results[1] == (([], 11), ([], 11), [], 2), results
    assert results[2] == (([], 11), [], 2), results


def test_a_rank_rejoining_while_another_is_gone_passes_over_the_clean_it_missed():
    """Rank 2 never calls; ranks 0 and 1 have rank 3 masked at clean 1 (where they declare rank 2 absent), then
    unmask it for clean 2. Rank 3 comes to clean 1 first, and when its wait there ends rank 2 is still missing:
    it must not stay there."""
    def steady(call: RollCall):
        time.sleep(0.2)
        first = call.clean(others(call.rank, 4, (3,)), [3], 0)
        second = call.clean(others(call.rank, 4, (2,)), [2], 0)
        return first[0], second[0], call._clean

    def rejoining(call: RollCall):
        return call.clean(others(call.rank, 4), [], 0)[0], call._clean

    results = run_ranks({0: steady, 1: steady, 3: rejoining}, 4)
    assert results[0] == ([2], [], 2) and results[1] == ([2], [], 2), results
    assert results[3] == ([2], 2), results


@pytest.mark.parametrize("cut_off_rank_masks_itself", [False, True])
def test_a_cut_off_rank_takes_no_clean_and_meets_the_others_later(cut_off_rank_masks_itself):
    """Rank 2 is cut off (it has every other rank masked) while ranks 0 and 1 clean without it; when all
    masks are cleared everyone cleans and meets."""
    def steady(call: RollCall):
        call.clean(others(call.rank, 3, (2,)), [2], 0)
        call.step(others(call.rank, 3, (2,)))
        time.sleep(0.2)
        return call.clean(others(call.rank, 3), [], 0)[0], call.step(others(call.rank, 3)), call._clean

    def cut_off(call: RollCall):
        call.clean([], [0, 1, 2] if cut_off_rank_masks_itself else [0, 1], 0)
        call.step([])
        return call.clean(others(call.rank, 3), [], 0)[0], call.step(others(call.rank, 3)), call._clean

    results = run_ranks({0: steady, 1: steady, 2: cut_off}, 3)
    assert results == {0: ([], [], 2), 1: ([], [], 2), 2: ([], [], 2)}, results


def test_two_ranks_that_sat_the_same_clean_out_rejoin_together():
    """Ranks 2 and 3 were masked by ranks 0 and 1 for one clean and come back together, before the others
    start it: at the missed clean they see each other (neither masks the other), but the ranks holding it
    have both masked; they pass over it and everyone meets at the next."""
    def steady(call: RollCall):
        time.sleep(0.2)
        first = call.clean(others(call.rank, 4, (2, 3)), [2, 3], 0)[0]
        return first, call.clean(others(call.rank, 4), [], 0)[0], call.step(others(call.rank, 4)), call._clean

    def rejoining(call: RollCall):
        return call.clean(others(call.rank, 4), [], 0)[0], call.step(others(call.rank, 4)), call._clean

    results = run_ranks({0: steady, 1: steady, 2: rejoining, 3: rejoining}, 4)
    assert results == {0: ([], [], [], 2), 1: ([], [], [], 2), 2: ([], [], 2), 3: ([], [], 2)}, results
