"""bench/schedule_model.py, the list-scheduling model of the forward's causal schedules: the short
first tile's key tiles, the grid numbering, the group rule (as GroupedOrder::dividing_group_for),
and the model's figures for the rows that have been compared with measurements."""
import importlib.util
import os

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def sm():
    spec = importlib.util.spec_from_file_location(
        "schedule_model", os.path.join(REPO, "bench", "schedule_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_first_tile(sm):
    costs = sm.key_tiles(4096, 192, 128)
    assert len(costs) == 22 and costs[0] == 1 and costs[-1] == 32
    assert sum(costs) == 363  # src/sm90/fwd/tile_rows.hpp, tests/cpu/test_tile_rows.cpp


def test_numbering(sm):
    costs = [1, 2, 3]
    assert sm.numbered(costs, 2, 1) == [3, 2, 1, 3, 2, 1]  # head by head, heaviest first
    assert sm.numbered(costs, 2, 2) == [3, 3, 2, 2, 1, 1]  # query tile by query tile
    assert sm.numbered(costs, 3, 2) == [3, 2, 1, 3, 3, 2, 2, 1, 1]  # the short group first


def test_dividing_group_matches_the_kernel_rule(sm):
    mb = 2**20
    assert sm.dividing_group(32, 4096, 2 * 256 * 2, 50 * mb) == 4
    assert sm.dividing_group(64, 4096, 2 * 128 * 2, 50 * mb) == 8
    assert sm.dividing_group(8, 16384, 2 * 256 * 2, 50 * mb) == 1
    assert sm.dividing_group(21, 4096, 2 * 128 * 2, 50 * mb) == 7
    assert sm.dividing_group(13, 4096, 2 * 128 * 2, 50 * mb) == 1


def test_figures_quoted_in_notes(sm):
    d256 = sm.model(256, 4096, 32, 1)
    assert round(d256["zigzag"], 3) == 1.031
    assert round(d256["greedy"], 3) == 1.139
    assert round(d256["grouped"], 3) == 1.000
    d128 = sm.model(128, 4096, 64, 1)
    assert round(d128["greedy"], 3) == 1.069
    assert round(sm.model(128, 16384, 64, 8)["greedy"], 3) == 1.003


def test_balanced_loads_read_one(sm):
    assert sm.greedy([1.0] * 264, ctas=132, overhead=0.0) == pytest.approx(1.0)
    assert sm.zigzag([1.0] * 264, ctas=132, overhead=0.0) == pytest.approx(1.0)


def test_zigzag_on_groups_as_the_causal_schedule(sm):
    # src/sm90/host/causal_schedule.hpp and tests/cpu/test_causal_schedule.cpp: d64 causal 512 and 2k
    # run the zig-zag in groups of 128 and 16 pairs.
    busiest, group = sm.model(64, 512, 1024, 1)["zz_group"]
    assert group == 128 and round(busiest, 3) == 1.045
    busiest, group = sm.model(64, 2048, 256, 1)["zz_group"]
    assert group == 16 and round(busiest, 3) == 1.044
    assert sm.model(128, 4096, 64, 1)["zz_group"][1] == 1  # balanced head by head
