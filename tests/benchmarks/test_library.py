"""The benchmarks as one library (``benchmarks/lib``) under thin entry points: no import cycles, one
definition of each shared notion, the child-process protocol, model preparation, the Ray
session's environment, and ``bench.png`` drawing only the sections that ran."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from tests.benchmarks.conftest import REPO

ENTRY_POINTS = (
    "compare",
    "gpu",
    "parity",
    "soak",
    "packing",
    "kernels",
    "trl_compare",
    "refit",
    "torch_backends",
    "jax_backend",
)


def test_no_import_cycles_and_the_library_imports_no_entry_point():
    """Function-level imports count too (grimp records them); so do package ``__init__`` modules."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("benchmarks", "core", "backends")
    mods = {m for m in graph.modules if m.split(".")[0] == "benchmarks"}
    edges = {m: {x for x in graph.find_modules_directly_imported_by(m) if x in mods} for m in mods}
    for m in mods:  # a module in a cycle reaches itself
        seen, todo = set(), list(edges[m])
        while todo:
            x = todo.pop()
            assert x != m, f"{m} is in an import cycle"
            if x not in seen:
                seen.add(x)
                todo.extend(edges[x])
    lib = {m for m in mods if m.startswith("benchmarks.lib")}
    up = [(m, x) for m in lib for x in edges[m] - lib]
    assert not up, f"library modules importing entry points: {up}"


def _definitions(root: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted((REPO / root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                out.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    return out


def test_each_shared_notion_is_defined_once():
    found = _definitions("benchmarks")
    for name in ("prepare_model", "Bench", "Size", "machine_facts", "HFRunner", "PolicyRunner", "RaySession"):
        assert len(found.get(name, [])) == 1, (name, found.get(name))
    # one Ray starter: the benchmarks (RaySession) and core.algorithms.placement.start_ray call it
    assert "start_ray" not in found, found["start_ray"]
    assert _definitions("core/distributed")["start_ray"] == ["core/distributed/ray_init.py"]


def test_every_entry_point_prints_its_help():
    """In one process: each ``python -m benchmarks.<name> --help`` exits 0 with a usage line."""
    script = textwrap.dedent(
        f"""
        import contextlib, io, runpy, sys
        for name in {ENTRY_POINTS!r}:
            sys.argv, out = ["x", "--help"], io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    runpy.run_module("benchmarks." + name, run_name="__main__")
                except SystemExit as stop:
                    assert stop.code in (0, None), (name, stop.code)
            assert out.getvalue().startswith("usage:"), (name, out.getvalue()[:200])
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# ----------------------------------------------------------------------------- child processes


def echo_once(spec: dict) -> None:
    from benchmarks.lib.child import reply

    print("library chatter is ignored")
    reply({"got": spec["x"]})
    reply({"got": spec["x"] + 1})


def echo_server(spec: dict) -> None:
    from benchmarks.lib.child import reply

    reply({"ready": spec["x"]})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        reply({"echo": line.strip()})


def fail(spec: dict) -> None:
    raise RuntimeError(f"boom {spec['x']}")


def test_child_protocol_one_shot_long_lived_and_a_dying_child():
    from benchmarks.lib.child import Child, run_child

    seen = []
    assert run_child("tests.benchmarks.test_library:echo_once", {"x": 1}, 1, seen.append) == [{"got": 1}, {"got": 2}]
    assert seen == [{"got": 1}, {"got": 2}]
    child = Child("tests.benchmarks.test_library:echo_server", {"x": 7}, 1)
    try:
        assert child.reply() == {"ready": 7}
        assert child.call("logprobs") == {"echo": "logprobs"} and child.call("train") == {"echo": "train"}
    finally:
        child.close()
    with pytest.raises(RuntimeError, match="boom 3"):
        run_child("tests.benchmarks.test_library:fail", {"x": 3}, 1)


# ----------------------------------------------------------------------------- models, Ray


def test_prepare_model_builds_the_names_it_knows_and_passes_the_rest(tmp_path):
    from benchmarks.lib.models import builds_here, prepare_model

    model, tok = prepare_model("tiny-qwen2", tmp_path)
    assert model == str(tmp_path / "qwen2") and tok == str(tmp_path / "qwen2" / "tokenizer")
    model, tok = prepare_model("arithmetic-llama", tmp_path)
    assert model == tok == str(tmp_path / "arithmetic-llama")
    assert prepare_model(model, tmp_path / "unused") == (model, tok)  # a saved model by path
    assert prepare_model("org/some-model", tmp_path) == ("org/some-model", "org/some-model")  # a hub id
    assert builds_here("tiny-gpt2") and builds_here("llama") and not builds_here("org/some-model")


def test_ray_session_replaces_the_device_count_and_leaves_omp_to_ray(monkeypatch):
    from benchmarks.lib.ray_session import RaySession
    from core.distributed.ray_init import jax_cpu_flags

    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    session = RaySession.__new__(RaySession)  # no Ray: only the environment it would start Ray with
    session.host_devices, session.devices = True, None
    session._set_environment(2)
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=2"
    assert "JAX_NUM_CPU_DEVICES" not in os.environ and "OMP_NUM_THREADS" not in os.environ
    # what core.distributed.ray_init.start_ray then adds: the count stays, Eigen's pool goes off
    assert jax_cpu_flags(os.environ["XLA_FLAGS"], 2).endswith(
        "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false"
    )


# ----------------------------------------------------------------------------- bench.png


def _results(grpo_only: bool) -> dict:
    grpo = {"step_s": 1.0, "phases_s": dict.fromkeys(("generation", "logprobs", "train"), 0.3), "trl_step_s": [0.9]}
    row = {"case": "dtensor-dp2", "grpo": grpo}
    if not grpo_only:
        row.update(logprobs_s=[0.5], train_s=[1.0], hf_logprobs_s=[0.4], hf_train_s=[0.8])
    return {"size": "tiny", "machine": {"device_name": "cpu"}, "hf": None, "layouts": [row]}


def test_the_chart_draws_only_the_sections_that_ran_and_keeps_legends_off_the_bars(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from benchmarks.lib.compare.plot import grpo_panel, panels, plot, throughput_panel

    assert panels(_results(grpo_only=True)) == [grpo_panel]  # --sections grpo: one panel
    assert panels(_results(grpo_only=False)) == [throughput_panel, grpo_panel]
    for panel in (grpo_panel, throughput_panel):
        fig, ax = plt.subplots()
        panel(ax, _results(grpo_only=False))
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1, panel.__name__  # right of the axes, not over them
        plt.close(fig)
    one = Image.open(plot(_results(grpo_only=True), tmp_path / "one.png")).size
    two = Image.open(plot(_results(grpo_only=False), tmp_path / "two.png")).size
    assert two[0] > 1.6 * one[0]  # one panel wide, not three with two empty
