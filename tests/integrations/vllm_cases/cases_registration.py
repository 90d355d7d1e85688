"""The plugin as vLLM 0.33 loads it: entry point, both ways of selecting CUTE_MLA_FP8, and spawned workers.

Each selection test runs in a fresh interpreter, as vLLM's own processes are: plugin loading, the backend
registry and the current platform are per-process state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
OUR_CLASS = "mla_backend.integrations.vllm.backend.CuteMLAFP8Backend"


def run_python(code: str, env_updates=None, timeout=300) -> str:
    """Run code in a fresh interpreter of this environment; returns its last stdout line."""
    env = dict(os.environ)
    env.pop("VLLM_ATTENTION_BACKEND", None)
    env.update(env_updates or {})
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc.stdout.strip().splitlines()[-1]


def test_entry_point_is_found_by_load_general_plugins():
    out = run_python("""
        from importlib.metadata import entry_points
        names = [ep.value for ep in entry_points(group="vllm.general_plugins")]
        assert "mla_backend.integrations.vllm:register" in names, names
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        assert "CUTE_MLA_FP8" not in AttentionBackendEnum.__members__
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        backend = AttentionBackendEnum["CUTE_MLA_FP8"]
        cls = backend.get_class()
        print(cls.__module__ + "." + cls.__qualname__, cls.get_name())
    """)
    assert out == f"{OUR_CLASS} CUTE_MLA_FP8"


def test_registration_is_idempotent_and_loads_no_cuda_or_kernels():
    out = run_python("""
        import sys
        import mla_backend.integrations.vllm as plugin
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        for _ in range(3):
            plugin.register()
        names = [n for n in AttentionBackendEnum.__members__ if n == "CUTE_MLA_FP8"]
        import torch
        loaded = sorted(m for m in sys.modules if m.startswith(("mla_backend.hopper", "cutlass")))
        print(len(names), AttentionBackendEnum["CUTE_MLA_FP8"].get_path(), torch.cuda.is_initialized(), loaded)
    """)
    assert out == f"1 {OUR_CLASS} False []"


def test_engine_args_and_cli_flag_resolve_to_our_backend(tmp_path):
    import tiny_deepseek

    model = tiny_deepseek.write_config(str(tmp_path / "tiny"))
    out = run_python(f"""
        from vllm_harness import use_hopper_platform
        use_hopper_platform()  # the CLI parser asks the platform for its device type, as on an H200 host
        from vllm.config import AttentionConfig
        from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        # EngineArgs loads the general plugins itself, before the name is parsed into the enum.
        args = EngineArgs(model={model!r}, attention_backend="CUTE_MLA_FP8", kv_cache_dtype="fp8")
        from_kwargs = AttentionConfig.validate_backend_before(args.attention_backend).get_class()

        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        ns = parser.parse_args(["--model", {model!r}, "--attention-backend", "CUTE_MLA_FP8",
                                "--kv-cache-dtype", "fp8"])
        cli = AsyncEngineArgs.from_cli_args(ns)
        from_cli = AttentionConfig.validate_backend_before(cli.attention_backend).get_class()
        print(from_kwargs.__module__ + "." + from_kwargs.__qualname__, from_cli is from_kwargs)
    """)
    assert out == f"{OUR_CLASS} True"


def test_environment_variable_selects_our_backend_for_unconfigured_mla_layers():
    code = """
        from vllm_harness import use_hopper_platform, select_mla_backend
        use_hopper_platform()
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        register_backend(AttentionBackendEnum.CUSTOM, "vllm_harness.ExplicitMLA")
        chosen = select_mla_backend()
        explicit = select_mla_backend({"backend": "CUSTOM"})
        per_kind = select_mla_backend({"backend_per_kind": {"mla_attention": "CUSTOM"}})
        print(chosen.get_name(), explicit.get_name(), per_kind.get_name())
    """
    # An explicit backend, global or for the MLA kind, wins over the variable.
    assert run_python(code, {"VLLM_ATTENTION_BACKEND": "CUTE_MLA_FP8"}) == "CUTE_MLA_FP8 EXPLICITMLA EXPLICITMLA"
    # Without the variable the platform chooses: our backend is never picked implicitly.
    assert run_python(code) == "PLATFORMDEFAULTMLA EXPLICITMLA EXPLICITMLA"


def test_environment_selection_rejects_a_bf16_cache_with_the_reason():
    out = run_python("""
        from vllm_harness import use_hopper_platform, select_mla_backend
        use_hopper_platform()
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        try:
            select_mla_backend(kv_cache_dtype="auto")
        except ValueError as e:
            print(str(e).replace("\\n", " "))
    """, {"VLLM_ATTENTION_BACKEND": "cute_mla_fp8"})
    assert "CUTE_MLA_FP8" in out and "--kv-cache-dtype fp8" in out


@pytest.mark.parametrize("engine, words", [
    (dict(dtype="float16"), ["dtype float16 is not supported", "--dtype bfloat16"]),
    (dict(num_speculative_tokens=8), ["speculative decoding with 8 draft tokens makes decode queries of 9 tokens",
                                      "num_speculative_tokens <= 7"]),
])
def test_selection_refuses_what_would_fail_after_the_model_loaded(tmp_path, engine, words):
    """An fp16 model (our bf16 output into vLLM's fp16 projection) and more than 7 draft tokens (verify blocks over
    8 tokens) are refused where vLLM selects the backend, inside the engine's configuration, with the reason."""
    import tiny_deepseek

    model = tiny_deepseek.write_config(str(tmp_path / "tiny"))
    out = run_python(f"""
        from vllm_harness import use_hopper_platform, select_mla_backend
        use_hopper_platform()
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        try:
            select_mla_backend({{"backend": "CUTE_MLA_FP8"}}, model={model!r}, **{engine!r})
            print("selected")
        except ValueError as e:
            print(str(e).replace("\\n", " "))
    """)
    assert "not valid for this configuration" in out, out
    for word in words:
        assert word in out, out


@pytest.mark.parametrize("selection", ["attention_backend", "environment"])
def test_spawned_worker_resolves_our_backend(selection):
    """A spawned worker unpickles the engine config before it loads any plugin (vLLM under CUDA or Ray)."""
    out = run_python(f"""
        import multiprocessing as mp
        import vllm_harness
        from vllm.config import AttentionConfig
        from vllm.plugins import load_general_plugins

        # python -c has no main module for the spawned child to re-import, so no __main__ guard is needed.
        load_general_plugins()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        if {selection!r} == "attention_backend":
            config = AttentionConfig(backend="CUTE_MLA_FP8")
            worker = ctx.Process(target=vllm_harness.worker_resolve_pickled_config, args=(config, queue))
        else:
            worker = ctx.Process(target=vllm_harness.worker_resolve_from_environment, args=(queue,))
        worker.start()
        worker.join(240)
        assert worker.exitcode == 0, f"worker exit code {{worker.exitcode}}"
        print(queue.get(timeout=5))
    """,
        {"VLLM_ATTENTION_BACKEND": "CUTE_MLA_FP8"} if selection == "environment" else None)
    if selection == "attention_backend":
        assert out == OUR_CLASS
    else:
        assert out == f"('CUTE_MLA_FP8', '{OUR_CLASS}')"


def test_backend_member_pickles_by_registration_not_by_value():
    out = run_python("""
        import pickle
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        member = AttentionBackendEnum["CUTE_MLA_FP8"]
        data = pickle.dumps(member)
        print(pickle.loads(data) is member, b"backend_member" in data, pickle.loads(pickle.dumps(AttentionBackendEnum.FLASHMLA)) is AttentionBackendEnum.FLASHMLA)
    """)
    assert out == "True True True"
