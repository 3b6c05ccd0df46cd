"""tools/sncaffe_memory.py: what an sncaffe process holds besides its pools, measured in a child."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sncaffe_memory  # noqa: E402


def test_step_rest_is_what_the_pools_do_not_explain():
    r = sncaffe_memory.measure_in_child((1, 1, 1, 1), 2, 32, "all")
    assert r["device"] > 0 and r["host"] > 0            # mode all offloads to the host pool
    assert (r["device"], r["host"]) == (r["planned_device"], r["planned_host"])   # the pools are the plan's
    assert 0 < r["rest"] < r["rss"]


def test_overhead_grows_with_the_planned_graph():
    o = sncaffe_memory.Overhead(2, 32)
    shallow, deep = o.plan_rss(1), o.plan_rss(60)
    assert deep > shallow                               # 180 more layers' graph and plan objects
    assert o(60, "none") == o.rest("none") + deep - shallow
    assert o(1, "none") == o.rest("none")
