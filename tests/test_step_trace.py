"""Attribution of a profiled window's kernels and blocking calls to engine steps by kind (synthetic profiler
events: the CUDA part cannot run on the CPU machine)."""

from __future__ import annotations

import pytest

from oasisbench.runners.step_trace import STEP_RANGE, parse_window, step_kind_lines


def _ev(name, cat, ts, dur, **args):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def test_kernels_go_to_the_step_that_launched_them():
    events = [
        _ev(STEP_RANGE, "user_annotation", 0, 100), _ev(STEP_RANGE, "user_annotation", 100, 20),
        _ev(STEP_RANGE, "user_annotation", 120, 20),
        # on CUDA the profiler repeats each range on the GPU timeline, once per stream: not steps
        _ev(STEP_RANGE, "gpu_user_annotation", 10, 40), _ev(STEP_RANGE, "gpu_user_annotation", 20, 30),
        # step 0 (prefill-carrying): two launches and a sync; its second kernel runs after the step's host range
        _ev("cudaLaunchKernel", "cuda_runtime", 5, 1, correlation=1),
        _ev("cudaLaunchKernel", "cuda_runtime", 6, 1, correlation=2),
        _ev("cudaStreamSynchronize", "cuda_runtime", 50, 40, **{"External id": 11}),
        _ev("aten::_local_scalar_dense", "cpu_op", 49, 42, **{"External id": 11, "Input Dims": [[4, 3]]}),
        _ev("cuLaunchKernelEx", "cuda_driver", 7, 1, correlation=5),   # a cuBLASLt GEMM: a driver-API launch
        _ev("gemm", "kernel", 60, 10, correlation=5, stream=7),
        _ev("attn", "kernel", 10, 30, correlation=1, stream=7),
        _ev("gather", "kernel", 20, 30, correlation=2, stream=9),      # overlaps attn: busy = 10..50 = 40
        # steps 1 and 2 (decode-only): one graph launch each, two kernels per launch
        _ev("cudaGraphLaunch", "cuda_runtime", 101, 2, correlation=3),
        _ev("cudaGraphLaunch", "cuda_runtime", 121, 2, correlation=4),
        _ev("k", "kernel", 103, 4, correlation=3, stream=7), _ev("k", "kernel", 108, 4, correlation=3, stream=7),
        _ev("k", "kernel", 123, 4, correlation=4, stream=7), _ev("k", "kernel", 128, 4, correlation=4, stream=7),
        _ev("orphan", "kernel", 500, 9, correlation=99, stream=7),     # no launch in the window: dropped
    ]
    text = "\n".join(step_kind_lines(events, ["prefill-carrying", "decode-only", "decode-only"], "t"))
    assert "3 profiled steps" in text
    assert "-- prefill-carrying: 1 steps, host wall 0.10 ms/step, GPU busy 0.05 ms/step (50% of the wall), " \
           "kernel time summed 0.07 ms/step, 3 kernels/step" in text
    assert "host blocked in cudaStreamSynchronize: 1.0/step, 0.04 ms/step" in text
    assert "host in CUDA API calls: 0.04 ms/step; cudaStreamSynchronize 1x 0.04 ms, cudaLaunchKernel 2x" in text
    assert "0.04 ms/step    1.0/step  cudaStreamSynchronize in aten::_local_scalar_dense [4,3]" in text
    assert "-- decode-only: 2 steps, host wall 0.02 ms/step, GPU busy 0.01 ms/step" in text
    assert "orphan" not in text


def test_mismatched_steps_are_not_attributed_and_windows_parse():
    lines = step_kind_lines([_ev(STEP_RANGE, "user_annotation", 0, 1)], ["decode-only", "decode-only"], "t")
    assert "not attributed" in lines[-1]
    assert parse_window("40:30") == ((40, 30),) and parse_window("") is None
    assert parse_window("150:20,20:40") == ((20, 40), (150, 20))
    for bad in ("40", "a:b", "-1:3", "3:0", "5:2,"):
        with pytest.raises(ValueError, match="START:COUNT"):
            parse_window(bad)
    with pytest.raises(ValueError, match="overlap"):
        parse_window("20:40,50:5")


def _timeline_module():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("trace_timeline",
                                                  Path(__file__).parents[1] / "bench" / "trace_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_timeline_finds_each_layers_prefetch_and_the_idle_link(tmp_path):
    """bench/trace_timeline.py on a synthetic trace of two 3-layer steps: the n-th attention / score / select /
    gather launch is layer n's; link idle is the gap since the previous gather (none when they queue); a gap on
    the main stream longer than --gap-us splits steps; a warm-up attention on another stream does not make that
    stream the main one."""
    import gzip
    import json

    tt = _timeline_module()
    ev = []

    def k(name, stream, ts, dur):
        ev.append({"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}})

    for step, t0 in enumerate((0.0, 5000.0)):
        for layer in range(3):
            a = t0 + layer * 1000
            k(tt.ATTENTION, 7, a, 100)
            k("gemm", 7, a + 100, 850)  # the rest of the layer on the main stream
            k(tt.SCORE, 8, a + 100, 100)
            k(tt.SELECT, 9, a + 200, 50)
            # step 0: each gather 600 us, starts at its selection's end (the link waits on the step);
            # step 1: 1,500 us each, back to back (the link sets the pace)
            start = a + 250 if step == 0 else t0 + 250 + layer * 1500
            k(tt.GATHER, 10, start, 600 if step == 0 else 1500)
    k(tt.ATTENTION, 11, 9000, 10)  # a stray launch on another stream
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev + [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}, f)
    t = tt.timeline(tt.load_kernels(str(path)), gap_us=300)
    rows = t["layers"]
    assert len(rows) == 7 and [r["layer"] for r in rows[:3]] == [0, 1, 2]
    assert abs(rows[1]["gather_start"] - 1.25) < 1e-9 and abs(rows[1]["select_end"] - 1.25) < 1e-9
    assert abs(rows[1]["link_idle_ms"] - 0.4) < 1e-9  # 1,250 - 850 us
    assert abs(rows[4]["link_idle_ms"]) < 1e-9 and abs(rows[4]["gather_ms"] - 1.5) < 1e-9  # back to back
    assert [s["layers"] for s in t["steps"]] == [3, 3]
    assert abs(t["steps"][0]["main_ms_per_layer"] - 2.95 / 3) < 1e-9 and t["steps"][1]["gathers"] == 3
    assert tt.main([str(path)]) == 0
    assert tt.main([str(tmp_path / "missing.json.gz")]) == 2


def test_interference_table_reads_the_committed_runs():
    """bench_kernels.py's interference table prints the committed H200 runs (run 3 has no call counts, run 4's
    rows are per attention config): one line per foreground and per gather variant, each with its slowdown."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("bench_kernels", root / "bench" / "bench_kernels.py")
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    for run, foregrounds in (("run3-hints-e77f462", 2), ("run4-attn-configs-39b696a", 5)):
        res = json.loads((root / "results" / "bench-overlap-h200" / run / "kernels.json").read_text())
        lines = list(bk.interference_lines(res["gather_interference"]))
        assert sum(" alone " in x and "ms" in x and "gather" not in x for x in lines) == foregrounds
        rows = [x for x in lines if "ms lost per GB" in x]
        assert len(rows) == foregrounds * len(bk.INTERFERENCE_GATHERS)
        assert all(" x1." in x for x in rows)
