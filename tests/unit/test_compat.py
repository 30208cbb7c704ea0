"""The compatibility boundary (runtime/base/compat.py): every library patch listed, in one module, inside the window.

Each workaround is listed here by name, with the library it bends; each is verified on a DeepSpeed
inside the tested window, which pyproject.toml's dependency states too; no other module patches a
library's attributes; and each patch does what its docstring says on the installed libraries.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Iterator

import pytest

from llm_train.runtime.base import compat
from tests.helpers import REPO

# Every patch of a library's internals and every workaround of a library's behaviour llm_train makes.
# A new one is added here and to compat.WORKAROUNDS; one that a new release makes unnecessary leaves both.
EXPECTED = {
    "remember_cpu_info": "deepspeed",
    "use_environment_ninja": "deepspeed",
    "build_ops_without_debug_info": "deepspeed",
    "defer_muon_compile": "deepspeed",
    "skip_unused_shm_op": "deepspeed",
    "restore_swapped_state": "deepspeed",
    "load_universal_checkpoint": "deepspeed",
    "clip_fp32_across_stages": "deepspeed",
    "keep_fp32_rope_buffers": "deepspeed",
    "keep_training_layout": "bitsandbytes",
    "without_hf_zero3_config": "transformers",
    "no_progress_bars": "lm_eval",
    "quantizing_on": "transformers",
    "gathered_for_generation": "deepspeed",
    "hub_kernels_off": "transformers",
}


def test_every_workaround_is_listed_with_the_version_it_was_verified_on() -> None:
    from packaging.specifiers import SpecifierSet

    listed = {w.name: w.library for w in compat.WORKAROUNDS}
    assert listed == EXPECTED
    for w in compat.WORKAROUNDS:
        fn = getattr(importlib.import_module(w.module), w.name)
        assert callable(fn) and fn.__doc__, w.name
        # The docstring names the version it describes, and that is the version listed.
        assert w.verified in fn.__doc__ or w.verified.rsplit(".", 1)[0] in fn.__doc__, w.name
        # ... and it lies inside its library's window (lm_eval is the module, lm-eval the distribution).
        window = compat.WINDOW[w.library.replace("_", "-")].tested
        assert w.verified in SpecifierSet(window), w


def _pyproject_requirements() -> dict[str, str]:
    """Every requirement pyproject.toml names, main and optional, as name -> specifier (the file's own text)."""
    from packaging.requirements import Requirement

    text = (REPO / "pyproject.toml").read_text()
    # Any quoted requirement with a version (a list item on its own line, or inline as the extras are).
    quoted = re.findall(r'"([A-Za-z][A-Za-z0-9_.\-]*(?:\[[^\]]*\])?[<>=~!][^"]*)"', text)
    return {Requirement(q).name: str(Requirement(q).specifier) for q in quoted}


def test_pyproject_states_every_tested_window() -> None:
    from packaging.specifiers import SpecifierSet

    stated = _pyproject_requirements()
    for window in compat.WINDOWS:
        assert window.library in stated, f"pyproject.toml does not bound {window.library}"
        assert SpecifierSet(stated[window.library]) == SpecifierSet(window.tested), window.library


def test_the_lock_lies_inside_every_window() -> None:
    """requirements-lock.txt, which make install installs, holds a release inside each window."""
    from packaging.specifiers import SpecifierSet

    locked = dict(
        re.findall(r"^([a-z0-9_.\-]+)==([^\s;]+)", (REPO / "requirements-lock.txt").read_text(), re.M)
    )
    for window in compat.WINDOWS:
        assert window.library in locked, f"requirements-lock.txt does not pin {window.library}"
        assert locked[window.library] in SpecifierSet(window.tested), (window.library, locked[window.library])
    assert "torch" not in locked  # a GPU machine keeps its CUDA torch; the Makefile pins the CPU one here


def test_every_deepspeed_version_the_package_cites_is_inside_the_window() -> None:
    """A comment that says "DeepSpeed 0.18 does X" describes a release the workarounds were not checked on."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    window = SpecifierSet(compat.DEEPSPEED_TESTED)
    cited = re.compile(r"DeepSpeed (\d+\.\d+(?:\.\d+)?)\b")
    outside = [
        f"{path.relative_to(REPO)}: DeepSpeed {version}"
        for path in sorted((REPO / "llm_train").rglob("*.py"))
        for version in cited.findall(path.read_text())
        # "0.19" stands for the 0.19 releases: inside when its first release in the window is.
        if not any(Version(v) in window for v in (version, f"{version}.8") if v.count(".") < 3)
    ]
    assert not outside, outside
    found = sum(len(cited.findall(p.read_text())) for p in (REPO / "llm_train").rglob("*.py"))
    assert found > 10  # the check reads the citations it is about


def test_a_library_outside_its_window_is_one_warning_line(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.version_problem("deepspeed", "0.19.8") is None
    assert compat.version_problem("transformers", "5.24.0") is None
    for library, version in (("deepspeed", "0.16.4"), ("deepspeed", "0.20.0"), ("transformers", "5.26.0")):
        problem, fix = compat.version_problem(library, version) or ("", "")
        assert (
            problem.startswith(f"{library} {version} is outside") and compat.WINDOW[library].tested in problem
        )
        assert compat.WINDOW[library].breaks in problem and "\n" not in problem
        assert fix == f"pip install '{library}{compat.WINDOW[library].tested}'"
    assert compat.version_problem("deepspeed", "not-a-version") is not None
    faked = {"transformers": "5.26.0", "peft": "0.20.1"}
    monkeypatch.setattr(
        compat, "installed_version", lambda lib: faked.get(lib, "0.19.8" if lib == "deepspeed" else None)
    )
    lines = compat.version_warnings()
    assert [line.split()[1] for line in lines] == ["transformers", "peft"]  # WINDOWS' order, one line each
    assert all(line.startswith("warning: ") and "\n" not in line for line in lines)


def test_the_installed_set_is_inside_every_window() -> None:
    """make test runs on the lock, so a run here starts with no version warning (the canary, which runs the
    suite on releases past the windows on purpose, leaves this test out and prints what moved itself)."""
    assert compat.version_warnings() == []


def test_doctor_warns_about_each_library_outside_its_window_and_nothing_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llm_train.commands import doctor

    # Every windowed library at its window's lowest release unless faked otherwise (not the installed set,
    # which the canary runs past the windows).
    inside = {w.library: w.tested.split(",")[0].removeprefix(">=") for w in compat.WINDOWS}

    def outside_for(faked: dict[str, str]) -> list[tuple[str, str]]:
        monkeypatch.setattr(compat, "installed_version", lambda lib: faked.get(lib) or inside.get(lib))
        report = doctor.Report()
        doctor.check_software(report, gpus=[])
        return [(p, fix) for p, fix in report.warnings if "is outside the versions" in p]

    assert outside_for({}) == []
    (warning,) = outside_for({"deepspeed": "0.16.4"})
    assert (
        "deepspeed 0.16.4" in warning[0] and warning[1] == f"pip install 'deepspeed{compat.DEEPSPEED_TESTED}'"
    )
    warned = outside_for({"accelerate": "1.15.0", "lm-eval": "0.4.14"})
    assert [p.split()[0] for p, _ in warned] == ["accelerate", "lm-eval"]


INTERNAL_LIBRARIES = ("transformers", "accelerate", "peft", "bitsandbytes", "deepspeed", "lm_eval")


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # the parent is a plain module, not a package
        return False


def _internal_names_imported() -> dict[str, str]:
    """ "module:name" -> file, for every name llm_train imports from inside these libraries (not their public
    surface: the top level and compat.PUBLIC_MODULES), and every private (_-prefixed) name imported anywhere."""
    found = {}
    for path in sorted((REPO / "llm_train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            library = node.module.split(".")[0]
            if library not in INTERNAL_LIBRARIES:
                continue
            public_module = node.module == library or node.module in compat.PUBLIC_MODULES
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"  # `from transformers import masking_utils`
                if _is_module(submodule):
                    if submodule not in compat.PUBLIC_MODULES:
                        found[f"{submodule}:*"] = str(path.relative_to(REPO))
                elif alias.name.startswith("_") or not public_module:
                    found[f"{node.module}:{alias.name}"] = str(path.relative_to(REPO))
    return found


def test_every_library_internal_llm_train_imports_is_listed() -> None:
    """A name from inside transformers/accelerate/peft/bitsandbytes/DeepSpeed/lm-eval is used only where
    compat.INTERNALS lists it."""
    imported = _internal_names_imported()
    listed_modules = {key.split(":")[0] for key in compat.INTERNALS}
    unlisted = {
        key: where
        for key, where in imported.items()
        if key not in compat.INTERNALS and not (key.endswith(":*") and key[:-2] in listed_modules)
    }
    assert not unlisted, f"list these in compat.INTERNALS (and check them): {unlisted}"
    # The scan sees the imports it is about: a private name, a name from an internal module, an internal module.
    assert "accelerate.commands.launch:_validate_launch_command" in imported
    assert "transformers.loss.loss_utils:LOSS_MAPPING" in imported
    assert "transformers.masking_utils:*" in imported
    assert "deepspeed.utils.groups:*" in imported and "lm_eval.tasks:TaskManager" in imported


def test_every_listed_internal_exists_in_the_installed_libraries() -> None:
    """The check a new release meets first: run by make test on the lock and by the canary on the newest."""
    import importlib

    missing = []
    for key in compat.INTERNALS:
        module, name = key.split(":")
        try:
            if not hasattr(importlib.import_module(module), name):
                missing.append(key)
        except ImportError:
            missing.append(key)
    assert not missing, f"gone from the installed libraries: {missing}"


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `scope`, not of the functions defined inside it."""
    for child in ast.iter_child_nodes(scope):
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield child
            yield from _own_nodes(child)


def _library_patches(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, target) of every assignment to an attribute of an imported third-party module, or setattr on one.

    A module is a name an import binds (anywhere in the file) or, within one function, a name bound
    to `importlib.import_module(...)`.
    """
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported |= {a.asname or a.name for a in node.names}
    own = {"llm_train", "annotations"}  # the package itself; `from __future__ import annotations`
    found = []
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    for scope in scopes:
        body = list(_own_nodes(scope))
        modules = imported - own
        modules |= {  # importlib.import_module("deepspeed.comm.torch"), in this function
            t.id
            for n in body
            if isinstance(n, ast.Assign | ast.AnnAssign) and isinstance(n.value, ast.Call)
            if ast.unparse(n.value.func).endswith("import_module")
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
        for node in body:
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
            for target in targets:
                base, entry = target, False
                # module.attr = ..., module.attr.sub = ..., and a library's module.TABLE[key] = ... (a
                # registry entry; os.environ[...] and sys.path[...] are the process's, not a library's)
                while isinstance(base, ast.Attribute | ast.Subscript):
                    entry |= isinstance(base, ast.Subscript)
                    base = base.value
                process_state = entry and isinstance(base, ast.Name) and base.id in sys.stdlib_module_names
                if (
                    target is not base
                    and isinstance(base, ast.Name)
                    and base.id in modules
                    and not process_state
                ):
                    found.append((node.lineno, ast.unparse(target)))
    return sorted(set(found))


def _module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def test_only_compat_patches_a_library() -> None:
    """A process-wide patch (a library module's attribute replaced) anywhere but in a module WORKAROUNDS names
    (compat itself, and the 4-bit base beside its own workarounds) would escape the list above."""
    homes = {_module_file(w.module) for w in compat.WORKAROUNDS}
    assert homes == {"llm_train/runtime/base/compat.py", "llm_train/runtime/model/quantized_base.py"}
    elsewhere = {
        (str(path.relative_to(REPO)), target)
        for path in (REPO / "llm_train").rglob("*.py")
        if str(path.relative_to(REPO)) not in homes
        for _, target in _library_patches(ast.parse(path.read_text()))
    }
    # Not a library's internals: sys.argv is swapped and put back around W&B's start (it records argv).
    assert elsewhere == {("llm_train/observability/tracking.py", "sys.argv")}
    here = {t for home in homes for _, t in _library_patches(ast.parse((REPO / home).read_text()))}
    # The rule sees the listed modules' own patches, as it would see them anywhere else.
    assert here == {
        "cpuinfo.get_cpu_info",
        "cpp_extension.load",
        "compiler.compile",
        "deepspeed_torch_backend.build_shm_op",
        "hf_deepspeed._hf_deepspeed_config_weak_ref",
        "tqdm.__init__",
        "auto.AUTO_QUANTIZER_MAPPING[key]",
    }


def test_deepspeed_op_loads_ask_py_cpuinfo_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_arch() and simd_width() of every op builder each asked it (a 1.1 s subprocess apiece)."""
    import cpuinfo
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    from llm_train.runtime.base.compat import remember_cpu_info

    calls = []

    def probe() -> dict[str, str]:
        calls.append(1)
        return {"arch": "X86_64", "flags": "avx2", "vendor_id_raw": "GenuineIntel"}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    assert remember_cpu_info()
    assert remember_cpu_info()  # a second call does not wrap the wrapper
    for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
        assert builder.cpu_arch() == "-march=native"
        assert builder.simd_width() == "-D__AVX256__"
    assert cpuinfo.get_cpu_info()["vendor_id_raw"] == "GenuineIntel"  # what DeepSpeedCPUAdam reads
    assert calls == [1]


def test_op_builds_use_the_environments_own_ninja(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Two ninjas on one machine do not read each other's build log: each rebuilt what the other built."""
    import sys

    from llm_train.runtime.base.compat import use_environment_ninja

    env_bin, system_bin = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    for folder in (env_bin, system_bin):
        folder.mkdir(parents=True)
        (folder / "ninja").write_text("#!/bin/sh\n")
        (folder / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(env_bin / "python"))
    environ = {"PATH": f"{system_bin}:/bin"}
    assert use_environment_ninja(environ)
    assert environ["PATH"] == f"{env_bin}:{system_bin}:/bin"
    assert not use_environment_ninja(environ)  # PATH finds it already: left as it is
    (env_bin / "ninja").unlink()
    environ = {"PATH": f"{system_bin}:/bin"}
    assert not use_environment_ninja(environ) and environ["PATH"] == f"{system_bin}:/bin"


def test_deepspeeds_muon_kernels_compile_at_their_first_call_not_at_import() -> None:
    """Every ZeRO engine imports DeepSpeed's Muon module; its torch.compile imported inductor (1 s/process)."""
    import subprocess
    import sys

    from tests.helpers import REPO

    # A fresh interpreter: whether inductor and the Muon module are imported is process-wide state.
    code = """
import sys, torch
from llm_train.runtime.base.compat import defer_muon_compile
assert defer_muon_compile()
from deepspeed.runtime.zero.muon import original_muon
assert "torch._inductor.compile_fx" not in sys.modules, "inductor imported with the Muon module"
assert not defer_muon_compile()  # imported already: nothing left to defer
compiled = []
torch.compile = lambda fn: compiled.append(fn.__name__) or fn  # records what a first call compiles
g = torch.randn(4, 6)
first = original_muon.zeropower_via_newtonschulz5(g, 2)
again = original_muon.zeropower_via_newtonschulz5(g, 2)
assert compiled == ["zeropower_via_newtonschulz5"], compiled  # compiled once, at the first call
assert torch.equal(first, again) and first.shape == (4, 6)
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_deepspeeds_op_builds_compile_without_debug_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """-g made a third of every op's compile time (torch's headers' debug information); -g0 goes last."""
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from llm_train.runtime.base.compat import NO_DEBUG_INFO, build_ops_without_debug_info

    class Built(Exception):
        pass

    asked: list[list[str]] = []

    def load(*args: object, **kwargs: list[str]) -> None:
        asked.append(kwargs["extra_cflags"])
        raise Built  # stands for the compile: nothing is built here

    monkeypatch.setattr(cpp_extension, "load", load)
    assert build_ops_without_debug_info()
    assert not build_ops_without_debug_info()  # a second call does not wrap the wrapper
    with pytest.raises(Built):
        CPUAdamBuilder().jit_load(verbose=False)  # DeepSpeed's own build path, flags as it makes them
    (flags,) = asked
    assert "-g" in flags and flags[-1] == NO_DEBUG_INFO, flags  # the last -g option is the one gcc takes


def test_deepspeeds_shared_memory_op_is_never_built() -> None:
    """DeepSpeed's CPU backend built its shm all-reduce op (70.8 CPU-s once, ~0.2 s per worker) for
    inference_all_reduce, which no training run calls; after skip_unused_shm_op it falls back to torch."""
    import subprocess
    import sys

    from tests.helpers import REPO

    # A fresh interpreter: the patched DeepSpeed backend is process-wide state.
    code = """
import torch.distributed as dist
from deepspeed.ops.op_builder.cpu import comm
from llm_train.runtime.base.compat import skip_unused_shm_op
def refuse(self, *args, **kwargs):
    raise AssertionError(f"{self.NAME} was built or loaded")
comm.ShareMemCommBuilder.load = comm.ShareMemCommBuilder.jit_load = refuse
assert skip_unused_shm_op()
from llm_train.runtime.base.launch_env import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
import deepspeed
deepspeed.init_distributed("gloo")  # the CPU accelerator's TorchBackend, as a training worker makes it
import importlib
backend = importlib.import_module("deepspeed.comm.comm").cdb
assert type(backend).__name__ == "TorchBackend" and backend.shm_comm_op is None
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_transformers_loads_no_hub_kernels_unless_the_user_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.integrations import hub_kernels

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    assert hub_kernels._kernels_enabled()  # transformers' default: kernelize at every from_pretrained
    assert compat.hub_kernels_off()
    assert not hub_kernels._kernels_enabled()  # read at each load, so setting it at start-up is enough
    monkeypatch.setenv("USE_HUB_KERNELS", "YES")  # the user's own choice stays
    assert not compat.hub_kernels_off() and hub_kernels._kernels_enabled()


def test_every_entry_point_turns_hub_kernels_off_before_a_model_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llm_train.cli import main
    from llm_train.runtime.session import prepare_libraries

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    prepare_libraries(verbose=False)  # every worker (train.py) and bench/ start here
    assert compat.os.environ["USE_HUB_KERNELS"] == "NO"
    monkeypatch.delenv("USE_HUB_KERNELS")
    assert main(["recipes"]) == 0  # the llm-train commands (generate, chat, export, eval, ...)
    assert compat.os.environ["USE_HUB_KERNELS"] == "NO"
