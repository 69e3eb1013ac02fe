"""tools/worker_products.py: a worker's step from oneDNN's timestamped log."""

from tools import worker_products

LOG = """\
onednn_verbose,v1,primitive,info,template:timestamp,operation,engine
onednn_verbose,v1,1000.0,primitive,exec,cpu,reorder,jit:uni,undef,,,,1024x1024,2.0
onednn_verbose,v1,1010.0,primitive,exec,cpu,gemm_api,,undef,src:f32::blocked:ab::f0,,,256x1024:1024x1024,10.0
onednn_verbose,v1,1030.0,primitive,exec,cpu,gemm_api,,undef,src:f32::blocked:ba::f0,,,1024x256:256x1024,10.0
onednn_verbose,v1,1035.0,primitive,exec,cpu,gemm_api,,undef,src:f32::blocked:ba::f0,,,1024x256:256x1024,10.0
onednn_verbose,v1,1100.0,primitive,exec,cpu,gemm_api,,undef,src:f32::blocked:ab::f0,,,256x1024:1024x1024,10.0
"""


def test_parse_keeps_exec_lines_with_start_and_end():
    events = worker_products.parse(LOG.splitlines())
    assert events[0] == (1000.0, 1002.0, "reorder", "1024x1024")
    assert [e[2] for e in events] == ["reorder"] + ["gemm_api"] * 4
    assert events[2] == (1030.0, 1040.0, "gemm_api", "1024x256:256x1024")


def test_account_of_one_step():
    # The step runs from 995 to 1060: a reorder, a product, two products
    # that overlap by 5 ms; the product at 1100 belongs to the next step.
    events = worker_products.parse(LOG.splitlines())
    row = worker_products.account(events, 995.0, 1060.0)
    assert row == {"step": 65.0, "busy": 2.0 + 10.0 + 15.0,
                   "products": 30.0, "reorders": 2.0, "count": 3,
                   "head": 5.0, "first_product": 15.0, "tail": 15.0,
                   "gaps": 45.0 - 27.0}


def test_median_account_over_steps():
    events = worker_products.parse(LOG.splitlines())
    row = worker_products.median_account(events, [995.0, 1060.0, 1115.0,
                                                  1200.0])
    # Steps of 65, 55 (one product) and 85 ms (none): medians per key.
    assert row["step"] == 65.0
    assert row["count"] == 1
