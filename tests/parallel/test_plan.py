"""Sharding types, plans (JSON), the hand-written plan helpers and the planner.

No device work here: plans are plain data and the planner is a cost model. The
Criteo-sized plan must fit the given memory per device and keep the slowest device
within the stated tolerance (10%) of the mean; constraints are honoured; the memory the
planner counts is the memory the sharded module allocates.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from parallel_testing import PLANS, TABLES, plan

import jaxrec.parallel as par
from jaxrec.data import CRITEO_KAGGLE_CARDINALITIES
from jaxrec.nn import EmbeddingBagConfig
from jaxrec.optim import Adam, RowWiseAdagrad
from jaxrec.parallel import ShardingType as ST
from jaxrec.parallel._layout import build_layout

GIB = 1 << 30
CRITEO = [par.TableSpec(f"t_C{i + 1}", n, 128, (f"C{i + 1}",))
          for i, n in enumerate(CRITEO_KAGGLE_CARDINALITIES)]


def test_hand_written_plans_tile_their_tables():
    p = plan("mixed")
    assert p["t_user"].sharding_type == ST.TABLE_WISE and p["t_user"].ranks == (5,)
    rows = p["t_item"].shards  # 23 rows over 8 devices: blocks of 3, the last one 2
    assert [(s.row_offset, s.num_rows, s.device) for s in rows] == \
        [(3 * d, 3 if d < 7 else 2, d) for d in range(8)]
    assert [(s.col_offset, s.num_cols) for s in p["t_geo"].shards] == [(0, 2), (2, 2)]
    assert p["t_x"].ranks == (4, 5, 6, 7)  # host 1 of 2 hosts x 4 devices
    assert p["t_tiny"].shards == () and p["t_tiny"].ranks == tuple(range(8))
    tiny = plan("row_wise")["t_tiny"].shards  # 3 rows: devices 3..7 hold none
    assert [s.num_rows for s in tiny] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_plans_round_trip_through_json(tmp_path):
    for kind in PLANS:
        p = plan(kind)
        again = par.ShardingPlan.load(p.save(tmp_path / f"{kind}.json"))
        assert again == p and hash(again) == hash(p)
        assert json.loads((tmp_path / f"{kind}.json").read_text())["format"] == \
            "jaxrec.parallel.ShardingPlan/1"
    with pytest.raises(ValueError, match="not a jaxrec sharding plan"):
        par.ShardingPlan.from_json({"format": "torchrec"})


def test_bad_plans_are_refused_with_the_fix():
    t = TABLES[0]  # t_user, 37 x 8
    gap = par.ParameterSharding(sharding_type="row_wise", ranks=(0, 1), shards=(
        par.Shard(row_offset=0, num_rows=10, col_offset=0, num_cols=8, device=0),
        par.Shard(row_offset=11, num_rows=26, col_offset=0, num_cols=8, device=1)))
    with pytest.raises(ValueError, match="do not tile the table; build them with"):
        gap.check(t.name, 37, 8, 2)
    with pytest.raises(ValueError, match=r"ranks must be devices in \[0, 2\)"):
        par.table_wise(5)(37, 8, 2, 2).check(t.name, 37, 8, 2)
    with pytest.raises(ValueError, match=r"missing \['t_geo'"):
        par.construct_plan(TABLES, {t.name: par.row_wise() for t in TABLES if t.name != "t_geo"}, 8)
    with pytest.raises(ValueError, match="sharding type must be one of"):
        par.ParameterSharding(sharding_type="diagonal", ranks=(0,))


def test_criteo_plan_fits_the_memory_and_is_balanced():
    # 26 Kaggle tables (33.8M rows x 128, 17.3 GB in f32) on 8 devices with 4 GiB each:
    # the four largest tables cannot live on one device.
    topology = par.Topology(world_size=8, hbm_cap=4 * GIB, batch_size=2048)
    planner = par.EmbeddingShardingPlanner(topology, optimizer=RowWiseAdagrad(learning_rate=0.1))
    p = planner.plan(CRITEO)
    stats = p.stats
    assert stats.memory <= topology.hbm_cap
    assert stats.imbalance <= 1.10, p.table()
    assert set(p) == {t.name for t in CRITEO}
    big = [t.name for t in CRITEO if t.rows * 128 * 4 > 4 * GIB]
    assert big and all(p[name].sharding_type == ST.ROW_WISE for name in big)
    assert all(ps.sharding_type != ST.COLUMN_WISE for _, ps in p.items())  # rowwise state
    # The memory counted is what the sharded module allocates: its group buffers.
    layout = build_layout(CRITEO, p)
    rows = sum(g.layout.rows[0] for g in layout.groups)
    assert stats.weights == rows * 128 * 4 and stats.optimizer_state == rows * 4
    # A plan loaded from JSON gets the same estimates.
    again = par.estimate(CRITEO, par.ShardingPlan.from_json(p.to_json()), topology,
                         optimizer=RowWiseAdagrad(learning_rate=0.1))
    assert again.perf == stats.perf and again.memory == stats.memory
    # The same configs plan() takes: EmbeddingBagConfigs give the same estimates as TableSpecs.
    configs = [EmbeddingBagConfig(name=t.name, num_embeddings=t.rows, embedding_dim=t.dim,
                                  feature_names=list(t.features)) for t in CRITEO]
    from_configs = par.estimate(configs, p, topology, optimizer=RowWiseAdagrad(learning_rate=0.1))
    assert from_configs.perf == stats.perf and from_configs.memory == stats.memory
    text = p.table()
    assert "row_wise" in text and "t_C3" in text and "slowest device" in text
    assert text.splitlines()[1].split()[:4] == ["table", "type", "devices", "hosts"]
    assert "(tolerance 1.10)" in text


def test_planner_splits_a_heavy_table_to_balance_the_devices():
    # One multi-hot table costs 40x the others: table-wise, its device would be the
    # bottleneck; the planner splits it by columns (Adam updates columns independently).
    tables = [par.TableSpec(f"t{i}", 1000, 64, (f"f{i}",)) for i in range(8)]
    constraints = {"t0": par.ParameterConstraints(pooling_factors=(40.0,))}
    topology = par.Topology(world_size=4, hbm_cap=GIB, batch_size=512)
    p = par.EmbeddingShardingPlanner(topology, optimizer=Adam(learning_rate=0.1),
                                     constraints=constraints).plan(tables)
    assert p["t0"].sharding_type in (ST.COLUMN_WISE, ST.ROW_WISE) and len(p["t0"].ranks) > 1
    assert p.stats.imbalance <= 1.10, p.table()
    table_wise_only = par.estimate(tables, par.construct_plan(
        tables, {t.name: par.table_wise(i % 4) for i, t in enumerate(tables)}, 4), topology,
        optimizer=Adam(learning_rate=0.1), pooling_factors={"t0": (40.0,)})
    assert max(p.stats.perf) < max(table_wise_only.perf)


def test_constraints_are_honoured():
    tables = [par.TableSpec(f"t{i}", 500 * (i + 1), 32, (f"f{i}",)) for i in range(6)]
    constraints = {
        "t0": par.ParameterConstraints(sharding_types=["table_wise"], ranks=[3]),
        "t1": par.ParameterConstraints(sharding_types=["column_wise"], ranks=[0, 2]),
        "t2": par.ParameterConstraints(sharding_types=["data_parallel"]),
        "t3": par.ParameterConstraints(sharding_types=["table_row_wise"], ranks=[5]),
        "t4": par.ParameterConstraints(sharding_types=["row_wise"]),
    }
    topology = par.Topology(world_size=8, local_world_size=4, hbm_cap=GIB)
    p = par.EmbeddingShardingPlanner(topology, optimizer=Adam(learning_rate=0.1),
                                     constraints=constraints).plan(tables)
    assert (p["t0"].sharding_type, p["t0"].ranks) == (ST.TABLE_WISE, (3,))
    assert (p["t1"].sharding_type, p["t1"].ranks) == (ST.COLUMN_WISE, (0, 2))
    assert p["t2"].sharding_type == ST.DATA_PARALLEL
    assert (p["t3"].sharding_type, p["t3"].ranks) == (ST.TABLE_ROW_WISE, (4, 5, 6, 7))
    assert p["t4"].sharding_type == ST.ROW_WISE
    with pytest.raises(ValueError, match="reads whole rows"):
        par.EmbeddingShardingPlanner(topology, optimizer=RowWiseAdagrad(learning_rate=0.1),
                                     constraints={"t1": constraints["t1"]}).plan(tables)
    with pytest.raises(ValueError, match=r"tables \['nope'\] that are not among"):
        par.EmbeddingShardingPlanner(topology, constraints={"nope": constraints["t0"]}).plan(tables)


def test_plain_small_tables_go_data_parallel_and_too_big_plans_fail_clearly():
    tables = [par.TableSpec("tiny", 4, 16, ("a",)), par.TableSpec("big", 100_000, 16, ("b",))]
    p = par.EmbeddingShardingPlanner(par.Topology(world_size=4, hbm_cap=GIB)).plan(tables)
    assert p["tiny"].sharding_type == ST.DATA_PARALLEL  # plain: all-reducing 4 rows is cheap
    assert p["big"].sharding_type != ST.DATA_PARALLEL
    with pytest.raises(par.PlannerError, match=r"no plan fits: the best one needs .* GiB per "
                                               r"device .* alone need 0.12 GiB per device\. Add devices"):
        # 10**6 x 64 float32 = 0.24 GiB: half of it per device at best.
        par.EmbeddingShardingPlanner(par.Topology(world_size=2, hbm_cap=1 << 20)).plan(
            [par.TableSpec("huge", 10**6, 64, ("x",))])
    np.testing.assert_allclose(par.Topology(world_size=1, hbm_cap=1).send_seconds(1e9), 0.0)


def test_the_default_hbm_cap_is_most_of_the_device_allocator(monkeypatch):
    """Without hbm_cap, the topology takes 0.8 of the first local device's bytes_limit, or
    16 GiB where the device does not report one (the CPU)."""
    import jax

    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit", 16 << 30)
    assert par.Topology(world_size=2).hbm_cap == int(limit * 0.8)

    class Reporting:
        def memory_stats(self):
            return {"bytes_limit": 80 << 30}

    monkeypatch.setattr(jax, "local_devices", lambda: [Reporting()])
    assert par.Topology(world_size=2).hbm_cap == int((80 << 30) * 0.8)
    assert par.Topology(world_size=2, hbm_cap=5).hbm_cap == 5


def test_when_device_memory_runs_out_the_planner_places_tables_in_host_memory(tmp_path):
    """10**6 x 64 float32 rows with row-wise state: 0.24 GiB, more than two devices of 64 MiB
    hold even split by rows; with a fused optimizer the planner places it in host memory
    (counted against ddr_cap), the small table stays on the device."""
    import dataclasses

    tables = [par.TableSpec("huge", 10**6, 64, ("x",)), par.TableSpec("small", 1000, 64, ("y",))]
    topology = par.Topology(world_size=2, hbm_cap=64 << 20, ddr_cap=GIB)
    fused = RowWiseAdagrad(learning_rate=0.1)
    p = par.EmbeddingShardingPlanner(topology, optimizer=fused).plan(tables)
    assert p["huge"].placement == "host" and p["small"].placement is None
    stats = p.stats
    assert stats.memory <= topology.hbm_cap and 0 < stats.host_memory <= topology.ddr_cap
    per_device = max(s.num_rows for s in p["huge"].shards) * (64 * 4 + 4)  # rows and their state
    assert stats.host_memory == per_device
    assert par.ShardingPlan.load(p.save(tmp_path / "plan.json")) == p
    assert json.loads((tmp_path / "plan.json").read_text())["tables"]["huge"]["placement"] == "host"
    with pytest.raises(par.PlannerError, match="no plan fits"):  # plain tables stay on the device
        par.EmbeddingShardingPlanner(topology).plan(tables)
    with pytest.raises(par.PlannerError, match=r"0.12 GiB of host memory per device \(ddr_cap 1.0 MiB\)"):
        par.EmbeddingShardingPlanner(dataclasses.replace(topology, ddr_cap=1 << 20), optimizer=fused).plan(tables)
    # a table whose config places it in host memory is planned there, never data-parallel
    hosted = [dataclasses.replace(t, placement="host") for t in tables]
    p = par.EmbeddingShardingPlanner(par.Topology(world_size=2, hbm_cap=GIB, ddr_cap=GIB), optimizer=fused).plan(hosted)
    assert all(ps.placement is None and ps.sharding_type != ST.DATA_PARALLEL for ps in p.values())
    assert p.stats.host_memory > 0 and build_layout(hosted, p).groups[0].in_host_memory
