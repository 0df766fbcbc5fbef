"""Random bytes read a block at a time: each byte handed out once, across threads, blocks and a fork."""

from __future__ import annotations

import os
import threading

from riskserve.platform.entropy import random_bytes
from riskserve.platform.tracing import new_trace_id
from riskserve.serving.ids import new_ids


def test_ids_never_repeat_across_many_blocks() -> None:
    ids = [i for _ in range(2_000) for i in new_ids(3)]  # 96 KiB: 24 blocks, ids straddling their ends
    assert len(set(ids)) == len(ids) == 6_000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_threads_never_get_the_same_bytes() -> None:
    taken: list[list[bytes]] = [[] for _ in range(4)]

    def take(mine: list[bytes]) -> None:
        for _ in range(3_000):
            mine.append(random_bytes(16))

    threads = [threading.Thread(target=take, args=(mine,)) for mine in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [chunk for mine in taken for chunk in mine]
    assert len(set(every)) == len(every) == 12_000


def test_a_forked_child_does_not_hand_out_its_parents_bytes() -> None:
    random_bytes(16)  # a block is read and mostly unread: what the child would repeat without the hook
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send what it would use next, then leave without running pytest's teardown
        os.close(read_end)
        os.write(write_end, random_bytes(64))
        os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 64)
    os.close(read_end)
    os.waitpid(pid, 0)
    parent = random_bytes(64)
    assert len(child) == 64
    assert child != parent


def test_requests_larger_than_a_block_are_whole_and_fresh() -> None:
    first, second = random_bytes(10_000), random_bytes(10_000)
    assert len(first) == len(second) == 10_000
    assert first != second


def test_trace_ids_are_valid_and_distinct() -> None:
    ids = {new_trace_id() for _ in range(5_000)}
    assert len(ids) == 5_000
    assert all(len(i) == 32 and i != "0" * 32 for i in ids)
