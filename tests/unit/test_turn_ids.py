"""Turn ids: random, distinct, and not handed out twice by a forked child."""

from __future__ import annotations

import os
import re

from turnkeeper.supervisor.core import new_turn_id


def test_ids_are_distinct_across_many_reads_of_the_random_pool() -> None:
    ids = [new_turn_id() for _ in range(2000)]  # the pool holds 512
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"t_[0-9a-f]{16}", i) for i in ids)


def test_a_forked_child_does_not_repeat_the_ids_its_parent_has_yet_to_give() -> None:
    new_turn_id()  # the pool is filled, most of it not yet given
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_turn_id().encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert status == 0 and child != new_turn_id()
