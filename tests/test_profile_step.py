"""benchmarks/profile_step.py: the trace parser and categories on synthetic traces, and the CPU smoke run."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_step as ps  # noqa: E402

HLO = """HloModule jit_step, is_scheduled=true

%fused_concat (p0: bf16[8,4], p1: bf16[8,4]) -> bf16[8,8] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[8,4]{1,0} parameter(1)
  ROOT %concatenate.1 = bf16[8,8]{1,0} concatenate(%p0, %p1), dimensions={1}
}

%fused_reduce (p0: f32[8,8]) -> f32[8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %reduce.2 = f32[8]{0} reduce(%p0, %c), dimensions={1}, to_apply=%add
}

ENTRY %main (a: bf16[8,4]) -> f32[8] {
  %a = bf16[8,4]{1,0} parameter(0)
  %loop_concatenate_fusion = bf16[8,8]{1,0} fusion(%a, %a), kind=kLoop, calls=%fused_concat, metadata={op_name="jit(step)/transpose(jvp(LanguageModel))/layers_3/mlp/concatenate"}
  %input_reduce_fusion = f32[8]{0} fusion(%loop_concatenate_fusion), kind=kInput, calls=%fused_reduce, metadata={op_name="jit(step)/jvp(LanguageModel)/layers_0/attn_norm/reduce_sum"}
  %custom-call.3 = bf16[8,8]{1,0} custom-call(%a), custom_call_target="__cublas$gemm"
  %custom-call.4 = bf16[8,8]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %multiply.5 = f32[8]{0} multiply(%input_reduce_fusion, %input_reduce_fusion)
}
"""


def _trace(path):
    ev = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    kernels = [("loop_concatenate_fusion", "loop_concatenate_fusion", 100.0),
               ("input_reduce_fusion", "input_reduce_fusion", 200.0),
               ("nvjet_tst_128x256", "custom-call.3", 400.0),
               ("_fwd_kernel", "custom-call.4", 800.0),
               ("multiply_5", "", 10.0)]
    for step in range(2):
        for name, op, dur in kernels:
            args = {"hlo_module": "jit_step", "hlo_op": op} if op else {"hlo_module": "jit_step"}
            ev.append({"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": dur, "name": name, "args": args})
            ev.append({"ph": "X", "pid": 1, "tid": 8, "ts": 0, "dur": dur, "name": op or name})  # derived line
        ev.append({"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 999.0, "name": "other_module_kernel",
                   "args": {"hlo_module": "jit_other", "hlo_op": "fusion.9"}})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)


def test_gpu_trace_categories(tmp_path):
    run = tmp_path / "plugins" / "profile" / "2026_01_01"
    run.mkdir(parents=True)
    _trace(str(run / "host.trace.json.gz"))
    path = ps.find_trace(str(tmp_path))
    events, source = ps.device_events(ps.load_trace(path))
    assert source == "gpu" and len(events) == 12  # the "XLA Ops" line is not counted
    infos = ps.parse_hlo(HLO)
    assert infos["loop_concatenate_fusion"].root == "concatenate"
    assert "reduce" in infos["input_reduce_fusion"].fused_ops
    s = ps.summarize(events, 2, infos, module="jit_step")
    ms = s["per_step_ms"]
    assert ms["concatenate"] == pytest.approx(0.1) and ms["reduction"] == pytest.approx(0.2)
    assert ms["gemm"] == pytest.approx(0.4) and ms["attention"] == pytest.approx(0.8)
    assert ms["elementwise"] == pytest.approx(0.01)  # "multiply_5" found as multiply.5
    assert s["total_ms"] == pytest.approx(1.51)  # the other module's kernel is left out
    assert s["kernels"][0]["kernel"] == "_fwd_kernel"
    assert any(o["jax_op"].endswith("layers_*/mlp/concatenate") for o in s["ops"])


def test_the_decode_kernel_is_attention():
    # the decode step's Pallas kernel, named after itself (its HLO is a custom call that names no kernel)
    assert ps.categorize("fox_decode_attention", "", None) == "attention"
    assert ps.categorize("gemm_fusion_dot_173", "", None) == "gemm"


GEMM_HLO = """HloModule jit__generate

%gemm_fusion_dot.7_computation (parameter_0: bf16[8,768], parameter_1: bf16[768,3072]) -> bf16[8,3072] {
  %parameter_0 = bf16[8,768]{1,0} parameter(0)
  %parameter_1 = bf16[768,3072]{1,0} parameter(1)
  %dot.1 = bf16[3072,8]{0,1} dot(%parameter_1, %parameter_0), lhs_contracting_dims={0}, rhs_contracting_dims={1}, backend_config={"sizes":["128"]}
  ROOT %bitcast.2 = bf16[8,3072]{1,0} bitcast(%dot.1)
}

ENTRY %main (a: bf16[8,768], w: bf16[768,3072]) -> bf16[8,3072] {
  %a = bf16[8,768]{1,0} parameter(0)
  %w = bf16[768,3072]{1,0} parameter(1)
  %gemm_fusion_dot.7 = bf16[8,3072]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_fusion_dot.7_computation, metadata={op_name="jit(_generate)/while/body/LanguageModel/layers_0/attn/dot_general"}, backend_config={"fusion_backend_config":{"block_level_fusion_config":{"num_ctas":1,"num_stages":4,"num_warps":"2","output_tiles":[{"sizes":["16","32"]}]},"kind":"__triton_nested_gemm_fusion"}}
  %gemm_fusion_dot.8 = f32[4,8,768]{2,1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_fusion_dot.7_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"256","split_k":"4","num_stages":"3","num_warps":"4","num_ctas":"1"}}}
  %gemm_fusion_dot.9 = bf16[8,3072]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_fusion_dot.7_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"2","output_tiles":[{"sizes":["8","16"]}],"num_ctas":1,"num_stages":1,"is_tma_allowed":false}},"force_earliest_schedule":false}
  ROOT %loop_fusion = bf16[8,3072]{1,0} fusion(%gemm_fusion_dot.7), kind=kLoop, calls=%gemm_fusion_dot.7_computation, backend_config={"fusion_backend_config":{"kind":"__triton"}}
}
"""


def test_gemm_tilings_are_read_from_the_compiled_hlo():
    # both spellings of XLA's Triton GEMM configs (the nested one with its kind after or, as jaxlib 0.11.2 prints it
    # offline, before the config); the nested form's contracting tile comes from its dot
    infos = ps.parse_hlo(GEMM_HLO)
    assert infos["gemm_fusion_dot.7"].tiling == "tile 16x32 w2 s4 k128"
    assert infos["gemm_fusion_dot.9"].tiling == "tile 8x16 w2 s1 k128"
    assert infos["gemm_fusion_dot.8"].tiling == "tile 16x64 k256 split4 w4 s3"
    assert infos["loop_fusion"].tiling == ""


def test_missing_trace_is_a_clear_error(tmp_path):
    (tmp_path / "x.xplane.pb").write_bytes(b"")
    with pytest.raises(ps.TraceError, match="trace.json.gz"):
        ps.find_trace(str(tmp_path))


def test_parse_variant():
    assert ps.parse_variant("old:vocab_pad_multiple=1,loss_impl=logits") == (
        "old", {"vocab_pad_multiple": 1, "loss_impl": "logits"})
    assert ps.parse_variant("new") == ("new", {})
    with pytest.raises(ValueError, match="key=value"):
        ps.parse_variant("bad:oops")


@pytest.mark.slow
def test_quick_cpu_run(tmp_path):
    out = tmp_path / "p.json"
    # one layer instead of the tiny preset's 4 (a variant's overrides apply to the model config): the same
    # path through build, trace, parse and summary at a quarter of the compilation
    rows = ps.main(["--quick", "--variants", "old:vocab_pad_multiple=1,n_layers=1", "new:loss_impl=chunked,n_layers=1",
                    "--out", str(out)])
    assert [r.get("error") for r in rows] == [None, None]
    data = json.loads(out.read_text())
    assert data["meta"]["backend"] == "cpu" and len(data["rows"]) == 2
    for r in data["rows"]:
        assert r["trace_source"] == "cpu" and r["total_ms"] > 0 and r["kernels"]
        assert set(r["per_step_ms"]) == set(ps.CATEGORIES)
        assert r["per_step_ms"]["gemm"] > 0


def test_train_kernels_bytes_from_the_hlo_types():
    """benchmarks/checks/train_kernels.py (the offline step listing): every kernel of the module with the bytes its
    operands and outputs hold per the HLO types (bf16[8,4] = 64 bytes), in schedule order, with the layer index
    folded out of the op path; tuples count each array."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    env = dict(os.environ)
    import train_kernels as tk  # its sibling decode_kernels sets the no-device variables: put them back
    os.environ.clear()
    os.environ.update(env)

    assert tk.array_bytes("(f32[4,2]{1,0}, bf16[3]{0}, s32[])") == 32 + 6 + 4
    kernels = tk.kernels_with_bytes(HLO)
    assert [k["name"] for k in kernels] == ["loop_concatenate_fusion", "input_reduce_fusion", "custom-call.3",
                                            "custom-call.4", "multiply.5"]
    assert [k["kind"] for k in kernels] == ["kLoop", "kInput", "custom-call:__cublas$gemm",
                                            "custom-call:__gpu$xla.gpu.triton", "multiply"]
    assert [k["bytes"] for k in kernels] == [64 + 64 + 128, 128 + 32, 64 + 128, 64 + 128, 32 + 32 + 32]
    assert tk._fold(kernels[0]["op"]) == "transpose(jvp(LanguageModel))/layers_*/mlp/concatenate"


def test_train_kernels_reads_local_memory_and_scalar_loads_from_ptx(tmp_path):
    """``train_kernels.ptx_kernels`` (``--ptx``): per PTX entry, the local memory per thread and the global loads
    split into scalar (8/16-bit counted apart) and vector ones, across the dump's files."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    env = dict(os.environ)
    import train_kernels as tk
    os.environ.clear()
    os.environ.update(env)

    (tmp_path / "m.1.ptx").write_text(
        "//\n.visible .entry input_reduce_fusion_1(\n.param .u64 a\n)\n{\n.local .align 4 .b8 __local_depot0[256];\n"
        "ld.global.nc.b16 %rs1, [%rd1];\nld.global.nc.b16 %rs2, [%rd2];\nld.global.nc.b32 %r1, [%rd3];\n"
        "ld.global.nc.v4.b32 {%r2, %r3, %r4, %r5}, [%rd4];\nst.global.b32 [%rd5], %r1;\n}\n"
        "\n.visible .entry loop_add_fusion(\n.param .u64 b\n)\n{\nld.global.nc.v4.b16 {%rs1}, [%rd1];\n"
        "st.global.v2.b32 [%rd2], {%r1, %r2};\n}\n")
    (tmp_path / "m.2.ptx").write_text("\n.visible .entry wrapped_convert(\n)\n{\nld.global.u8 %rs1, [%rd1];\n}\n")
    got = tk.ptx_kernels(str(tmp_path))
    assert got["input_reduce_fusion_1"] == dict(local_bytes=256, scalar_loads=3, narrow_scalar_loads=2,
                                                vector_loads=1, scalar_stores=1, vector_stores=0)
    assert got["loop_add_fusion"] == dict(local_bytes=0, scalar_loads=0, narrow_scalar_loads=0, vector_loads=1,
                                          scalar_stores=0, vector_stores=1)
    assert got["wrapped_convert"]["narrow_scalar_loads"] == 1


SLICED_HLO = """HloModule m

%fused_slice_mul (p0: f32[4,8,8], p1: s32[], p2: f32[8,8]) -> f32[8,8] {
  %p0 = f32[4,8,8]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,8,8]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,8}
  %b = f32[8,8]{1,0} bitcast(%ds)
  %p2 = f32[8,8]{1,0} parameter(2)
  ROOT %m = f32[8,8]{1,0} multiply(%b, %p2)
}

%fused_dus (p0: f32[4,8,8], p1: f32[8,8], p2: s32[]) -> f32[4,8,8] {
  %p0 = f32[4,8,8]{2,1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %u = f32[1,8,8]{2,1,0} bitcast(%p1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,8,8]{2,1,0} dynamic-update-slice(%p0, %u, %p2, %z, %z)
}

ENTRY %main (stack: f32[4,8,8], i: s32[], x: f32[8,8]) -> f32[4,8,8] {
  %stack = f32[4,8,8]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[8,8]{1,0} parameter(2)
  %loop_multiply_fusion = f32[8,8]{1,0} fusion(%stack, %i, %x), kind=kLoop, calls=%fused_slice_mul
  ROOT %loop_dynamic_update_slice_fusion = f32[4,8,8]{2,1,0} fusion(%stack, %loop_multiply_fusion, %i), kind=kLoop, calls=%fused_dus
}
"""


def test_train_kernels_bytes_of_a_layer_slice_and_an_in_place_update():
    """A fusion that reads one layer of a scan's stacked [L, ...] array counts that layer (256 bytes of the
    1024), and an in-place dynamic-update-slice counts the update it writes, not the whole buffer."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    env = dict(os.environ)
    import train_kernels as tk
    os.environ.clear()
    os.environ.update(env)

    sliced, update = tk.kernels_with_bytes(SLICED_HLO)
    assert sliced["bytes"] == 256 + 4 + 256 + 256  # the slice, the index, x; the output
    assert update["bytes"] == 256 + 4 + 256  # the update and the index read; the update written


COUNTED_HLO = """HloModule m

%fused_ds (p0: f32[4,8], p1: s32[]) -> f32[1,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,8]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,8}
}

%body.2 (t: (s32[], f32[4,8], f32[8], f32[8], f32[8], f32[8], f32[8])) -> (s32[], f32[4,8], f32[8], f32[8], f32[8], f32[8], f32[8]) {
  %t = (s32[], f32[4,8]{1,0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %s = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %a = f32[8]{0} get-tuple-element(%t), index=2
  %b = f32[8]{0} get-tuple-element(%t), index=3
  %c = f32[8]{0} get-tuple-element(%t), index=4
  %d = f32[8]{0} get-tuple-element(%t), index=5
  %e = f32[8]{0} get-tuple-element(%t), index=6
  %start = ((f32[4,8]{1,0}, s32[]), f32[1,8]{1,0}, u32[]) fusion-start(%s, %i), kind=kLoop, calls=%fused_ds
  %done = f32[1,8]{1,0} fusion-done(%start)
  %sum = f32[8]{0} custom-call(%a, %b, %c, %d, %e, /*index=5*/%a), custom_call_target="six"
  ROOT %r = (s32[], f32[4,8]{1,0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}) tuple(%i, %s, %sum, %b, %c, %d, %e)
}

%cond.2 (t: (s32[], f32[4,8], f32[8], f32[8], f32[8], f32[8], f32[8])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (t: (s32[], f32[4,8], f32[8], f32[8], f32[8], f32[8], f32[8])) -> (s32[], f32[4,8], f32[8], f32[8], f32[8], f32[8], f32[8]) {
  %t = (s32[], f32[4,8]{1,0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}) parameter(0)
  ROOT %w = (s32[], f32[4,8]{1,0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, /*index=6*/f32[8]{0}) while(%t), condition=%cond.2, body=%body.2, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_train_kernels_counts_per_step():
    """A loop body's kernels run its known trip count times per step; an operand after the fifth (HLO writes
    ``/*index=5*/%a``) is counted; an async fusion is one kernel (its ``fusion-start``) that moves its slice,
    not the whole buffer its start's tuple names."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    env = dict(os.environ)
    import train_kernels as tk
    os.environ.clear()
    os.environ.update(env)

    kernels = tk.kernels_with_bytes(COUNTED_HLO)
    assert [(k["name"], k["launches"]) for k in kernels] == [("start", 3), ("sum", 3)]
    start, six = kernels
    assert start["bytes"] == 32 + 4 + 32  # the slice read (one row of the [4, 8] stack), the index; the row written
    assert six["bytes"] == 6 * 32 + 32  # six operands of f32[8], the sixth behind its index comment; the output


LOOP_HLO = """HloModule m

%inner (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %k = f32[] custom-call(%p), custom_call_target="mosaic_gpu_v2"
}

%body.1 (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %a = f32[] custom-call(%x), custom_call_target="__cublas$lt$matmul"
  ROOT %c = f32[] call(%a), to_apply=%inner
}

%cond.1 (x: f32[]) -> pred[] {
  %x = f32[] parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  ROOT %w = f32[] while(%x), condition=%cond.1, body=%body.1
}
"""


def test_scan_check_counts_the_calls_nested_in_a_loop_body():
    # benchmarks/checks/check_scan_grad.py: a kernel XLA wrapped in a called computation (a command buffer, an
    # async wrapper) is still launched by the loop's iteration (on an H100 the 760M check found no Mosaic call
    # directly in the backward loop's body)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    import check_scan_grad

    bodies = check_scan_grad._while_bodies(LOOP_HLO)
    assert list(bodies) == ["body.1"]
    assert 'custom_call_target="mosaic_gpu_v2"' in bodies["body.1"]
    assert "%cond.1" not in bodies["body.1"]
    # each attention call named with its results and operand count (cuBLAS calls are not listed)
    assert check_scan_grad._kernel_calls(bodies["body.1"]) == ["k in inner: f32[] <- 1 operands [mosaic_gpu_v2] "]


def test_offline_mosaic_check_parses_ptxas_and_ptx():
    """benchmarks/checks/offline_mosaic_check.py reads the plugin's ``ptxas -v`` report and PTX: registers,
    spills, stack, barriers, the setmaxnreg budgets and the wgmma count (a missing field is None, not 0)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    env = dict(os.environ)
    import offline_mosaic_check as om  # its sibling decode_kernels sets the no-device variables: put them back
    os.environ.clear()
    os.environ.update(env)

    report = ("ptxas info    : Function properties for entry_mosaic_gpu_kernel\n"
              "    216 bytes stack frame, 268 bytes spill stores, 280 bytes spill loads\n"
              "ptxas info    : Used 168 registers, used 16 barriers, 216 bytes cumulative stack size, 1 bytes smem\n")
    assert om.parse_ptxas(report) == {"registers": 168, "spill_stores": 268, "spill_loads": 280, "stack": 216,
                                      "barriers": 16}
    assert om.parse_ptxas("ptxas info : Used 96 registers")["spill_stores"] is None
    ptx = ("\tsetmaxnreg.inc.sync.aligned.u32 \t232;\n\tsetmaxnreg.dec.sync.aligned.u32 \t40;\n"
           "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};\n"
           "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...};\n")
    assert om.parse_ptx(ptx) == {"maxnreg_compute": 232, "maxnreg_memory": 40, "wgmma": 2}


def test_kv_shift_bench_variants_agree(tmp_path):
    """benchmarks/bench_kv_shift.py at a tiny shape on CPU: every variant's backward is compared with the
    library's before it is timed; the written-out ones (``current``, ``fused``) agree to float32 summation order
    (the row sums' kernels differ), plain autodiff to bf16 rounding (it rounds the shifted cotangent twice)."""
    import bench_kv_shift as bk

    out = tmp_path / "kv.json"
    assert bk.main(["--shape", "1x40x2x16", "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"current", "autodiff", "fused"}
    assert rows["fused"]["max_rel_err_vs_current"] < 1e-5
    assert 0.0 < rows["autodiff"]["max_rel_err_vs_current"] < 2e-2
    assert all(r["ms"] > 0 for r in rows.values())
    # against the float32 oracle every variant is within bf16 rounding, per output
    for r in rows.values():
        assert set(r["err_vs_oracle"]) == {"dk", "dalpha_k", "dv", "dalpha_v"}
        assert 0.0 < r["max_rel_err_vs_oracle"] < 2e-2, r


@pytest.mark.parametrize("argv", [["--shape", "1x256x2"], ["--shape", "0x256x2x64"], ["--variants", "bogus"],
                                  ["--bandwidth", "-1"], ["--out", "/nonexistent_folder/kv.json"]])
def test_kv_shift_bench_refuses_bad_input(argv, capsys):
    """bench_kv_shift.py: a shape that is not four positive ints, an unknown variant (it once timed the split form
    under the typo's name), a bandwidth ≤ 0 or an --out in a missing folder (it once failed after the timings) is a
    one-line argparse error naming the flag, before anything runs."""
    import bench_kv_shift as bk

    with pytest.raises(SystemExit) as e:
        bk.main(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err
