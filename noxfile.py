"""Sessions of the fabric monorepo.

`./dev demo` runs the `demo` session and `./dev test` the `check` session (what CI runs).
The fabric distributions are never taken from an index: every session installs them from
this tree by path (they are not on PyPI, and a squatter could publish the names).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.needs_version = ">=2024.10.9"
nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["check"]
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
CONSTRAINTS = ("-c", str(ROOT / "constraints" / "ci.txt"))
PACKAGES = ("packages/fabric-core", "packages/fabric-sim", "packages/fabric-apps")


def _install(session: nox.Session, *groups: str, editable: bool = True) -> None:
    """The local packages (by path) plus the named dependency groups, under the pins."""
    local: list[str] = []
    for pkg in PACKAGES:
        local += ["-e", pkg] if editable else [pkg]
    deps = [d for g in groups for d in nox.project.dependency_groups(PYPROJECT, g)]
    session.install(*CONSTRAINTS, *local, *deps)


def _system_packages(session: nox.Session, *packages: str) -> None:
    """Debian packages a session needs: installed when missing and we are root, else named.
    Elsewhere than Debian/Ubuntu the build itself says what is missing."""
    if not shutil.which("dpkg"):
        return
    missing = [
        p for p in packages if subprocess.run(["dpkg", "-s", p], capture_output=True, check=False).returncode
    ]
    if not missing:
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-qq", external=True, env=env)
        session.run("apt-get", "install", "-y", "-qq", *missing, external=True, env=env)
    else:
        session.error(f"this session needs system packages: sudo apt-get install {' '.join(missing)}")


def _lint(session: nox.Session) -> None:
    session.run("ruff", "check", "packages", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "packages", "tests", "benchmarks", "noxfile.py")


def _typecheck(session: nox.Session) -> None:
    session.run("mypy")


def _docs(session: nox.Session) -> None:
    site = str(Path(session.create_tmp()) / "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})


def _pytest(session: nox.Session) -> None:
    _system_packages(session, "g++")  # tests/test_native_frames.py builds a native program
    session.run(
        "pytest",
        "--cov",
        "--cov-report=term",
        f"--cov-report=xml:{ROOT / 'coverage.xml'}",
        *session.posargs,
        env={"COVERAGE_FILE": str(ROOT / ".coverage")},
    )


@nox.session
def check(session: nox.Session) -> None:
    """Everything CI runs: lint, types, docs, the test suite with coverage, fabric-efa and
    fabric-verbs, then the native code under sanitizers."""
    _install(session, "test", "lint", "docs")
    _lint(session)
    _typecheck(session)
    _docs(session)
    _pytest(session)
    _efa(session)  # last: installing the backends changes what the registry tests see
    _efa_on_libfabric2(session)
    _verbs(session)
    _sanitize(session)  # replaces the backends with their ASan+UBSan builds: keep it last


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite only (pass pytest options after --)."""
    _install(session, "test")
    _pytest(session)


@nox.session
def lint(session: nox.Session) -> None:
    _install(session, "lint")
    _lint(session)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on fabric_core and fabric_sim. The test group too: the conformance suite,
    the metrics exporter and the apps' benchmarks import pytest, hypothesis,
    prometheus-client and torch, whose types mypy reads (without them it failed alone, while
    ``check``, which installs every group, passed)."""
    _install(session, "test", "lint")
    _typecheck(session)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation with mkdocs --strict."""
    _install(session, "docs")
    _docs(session)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on the simulator: the contract walk-through, `fabric info`, a bench sweep."""
    _install(session, editable=False)
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    session.run("fabric", "demo")
    session.run("fabric", "info", "--backend", "sim")
    session.run(
        "fabric", "bench", "--backend", "sim", "--json", str(out / "sim-sweep.json"), *session.posargs
    )


@nox.session
def bench(session: nox.Session) -> None:
    """The simulator baseline: a full sweep, committed as JSON and a plot in benchmarks/results."""
    _install(session, editable=False)
    session.install(*CONSTRAINTS, "matplotlib")
    out = ROOT / "benchmarks" / "results"
    session.run(
        "fabric", "bench", "--backend", "sim", "--json", str(out / "sim-baseline.json"), *session.posargs
    )
    session.run(
        "python", "benchmarks/plot_sweep.py", str(out / "sim-baseline.json"), str(out / "sim-baseline.png")
    )


def _efa(session: nox.Session) -> None:
    """Build fabric-efa against the system libfabric (installing libfabric-dev when missing),
    check its stub with stubtest, and run the conformance suite on shm and tcp;ofi_rxm."""
    _efa_install(session)
    session.run(
        "pytest",
        "packages/fabric-efa/tests",
        "-q",
        "--fabric-seeds",
        os.environ.get("FABRIC_EFA_SEEDS", "2"),
        "--cov=fabric_efa",
        "--cov=fabric_core",
        "--cov-report=term",
        *session.posargs,
        env={"FI_TCP_IFACE": "lo", "COVERAGE_FILE": str(ROOT / ".coverage.efa")},
    )


def _efa_install(session: nox.Session) -> None:
    """fabric-efa built against the system libfabric and installed, its stub checked."""
    _system_packages(session, "libfabric-dev", "g++", "cmake", "pkg-config", "iproute2", "nftables")
    session.install(*CONSTRAINTS, "pybind11", "scikit-build-core")
    session.install(*CONSTRAINTS, "--no-build-isolation", "./packages/fabric-efa")
    session.run(
        "python",
        "-m",
        "mypy.stubtest",
        "fabric_efa._efa",
        "--allowlist",
        "packages/fabric-efa/stubtest-allowlist.txt",
    )


def _build_libfabric2(session: nox.Session) -> Path:
    """libfabric 2.x (shm, tcp, rxm) built once into nox's cache (tools/libfabric2.sh, which
    fetches Debian 13's source by its hash); returns its lib folder."""
    _system_packages(session, "autoconf", "automake", "libtool", "make", "g++", "xz-utils")
    prefix = Path(session.cache_dir) / "libfabric2"
    session.run("bash", str(ROOT / "tools" / "libfabric2.sh"), str(prefix), external=True)
    return prefix / "lib"


def _efa_on_libfabric2(session: nox.Session) -> None:
    """The fabric-efa that _efa built (against the system's libfabric 1.17) run against
    libfabric 2.x: the conformance suite and the efa tests on shm and tcp;ofi_rxm, as a wheel
    built on one system meets a newer libfabric on another (the EFA installer's)."""
    lib = _build_libfabric2(session)
    env = {"LD_LIBRARY_PATH": str(lib), "FI_TCP_IFACE": "lo"}
    session.run(  # (the 2.x build is the one loaded)
        "python",
        "-c",
        "import sys, fabric_efa._efa as e; v = e.libfabric_version(); print('libfabric', v); "
        "sys.exit(v < (2, 0))",
        env=env,
    )
    session.run(
        "pytest",
        "packages/fabric-efa/tests",
        "-q",
        "--fabric-seeds",
        os.environ.get("FABRIC_EFA2_SEEDS", "1"),
        *session.posargs,
        env=env,
    )


@nox.session(name="efa-libfabric2")
def efa_libfabric2(session: nox.Session) -> None:
    """fabric-efa built against the system libfabric, run against libfabric 2.x (built once
    from Debian 13's source into nox's cache); also part of ``check``."""
    _install(session, "test", "lint")
    _efa_install(session)
    _efa_on_libfabric2(session)


def _verbs(session: nox.Session) -> None:
    """Build fabric-verbs against the system libibverbs (installing libibverbs-dev when missing),
    check its stub, and run its tests: the device-free parts here, the conformance suite where an
    RDMA device exists (collected and skipped with the reason elsewhere)."""
    _system_packages(session, "libibverbs-dev", "g++", "cmake", "pkg-config")
    session.install(*CONSTRAINTS, "pybind11", "scikit-build-core")
    session.install(*CONSTRAINTS, "--no-build-isolation", "./packages/fabric-verbs")
    session.run(
        "python",
        "-m",
        "mypy.stubtest",
        "fabric_verbs._verbs",
        "--allowlist",
        "packages/fabric-verbs/stubtest-allowlist.txt",
    )
    session.run(
        "pytest",
        "packages/fabric-verbs/tests",
        "-q",
        "--fabric-seeds",
        os.environ.get("FABRIC_VERBS_SEEDS", "2"),
        "--cov=fabric_verbs",
        "--cov-report=term",
        *session.posargs,
        env={"COVERAGE_FILE": str(ROOT / ".coverage.verbs")},
    )


@nox.session
def efa(session: nox.Session) -> None:
    """fabric-efa only: build, stubtest, conformance on shm and tcp (FABRIC_EFA_SEEDS seeds)."""
    _install(session, "test", "lint")
    _efa(session)


@nox.session
def verbs(session: nox.Session) -> None:
    """fabric-verbs only: build, stubtest, tests (the conformance suite where an RDMA device exists)."""
    _install(session, "test", "lint")
    _verbs(session)


@nox.session(venv_backend="none")
def ceiling(session: nox.Session) -> None:
    """The raw-libfabric ceiling (benchmarks/ceiling/fi_ceiling.c) on shm and tcp;ofi_rxm."""
    _system_packages(session, "libfabric-dev", "gcc")
    build = Path(session.create_tmp()) / "fi_ceiling"
    session.run(
        "cc", "-O2", "-Wall", "-o", str(build), "benchmarks/ceiling/fi_ceiling.c", "-lfabric", external=True
    )
    out = ROOT / "benchmarks" / "results"
    for provider, tag in (("shm", "shm"), ("tcp;ofi_rxm", "tcp")):
        with open(out / f"ceiling-{tag}.jsonl", "w") as sink:
            session.run(
                str(build),
                "-p",
                provider,
                *session.posargs,
                external=True,
                stdout=sink,
                env={"FI_TCP_IFACE": "lo"},
            )


@nox.session(venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """On a machine with a CUDA GPU: the GPU tests (tests/gpu), then the GPU benchmarks
    (benchmarks/gpu_bench.py → bench-results/gpu.json and .png; gpu_apps.py → apps.json;
    gpu_per_wr.py → per-wr.txt); with two GPUs or more, the NCCL comparisons too (gpu_two.py →
    two.json; gpu_two_apps.py → two-apps.json). torch comes from the machine's own
    site-packages (its CUDA build: the pinned CPU build of CI would not do)."""
    _system_packages(session, "libfabric-dev", "g++", "cmake", "pkg-config")
    session.install(*[a for pkg in PACKAGES for a in ("-e", pkg)], "pytest", "hypothesis", "matplotlib")
    session.install("pybind11", "scikit-build-core")
    session.install("--no-build-isolation", "./packages/fabric-efa")
    session.run("pytest", "tests/gpu", "-v", "-rs", *session.posargs, env={"FI_TCP_IFACE": "lo"})
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    session.run(
        "python", "benchmarks/gpu_bench.py", "--out", str(out / "gpu.json"), "--plot", str(out / "gpu.png")
    )
    session.run("python", "benchmarks/gpu_apps.py", "--out", str(out / "apps.json"))
    with open(out / "per-wr.txt", "w") as f:
        session.run("python", "benchmarks/gpu_per_wr.py", stdout=f)
    gpus = session.run(
        "python", "-c", "import torch; print(torch.cuda.device_count())", silent=True, log=False
    )
    if gpus is not None and int(str(gpus).strip().splitlines()[-1]) >= 2:
        session.run("python", "benchmarks/gpu_two.py", "--out", str(out / "two.json"))
        session.run("python", "benchmarks/gpu_two_apps.py", "--out", str(out / "two-apps.json"))


@nox.session(name="efa-bench")
def efa_bench(session: nox.Session) -> None:
    """fabric-efa against the raw-libfabric ceiling, alternating, 3 repetitions per provider;
    JSON and plot to benchmarks/results (efa-vs-ceiling.*). With FABRIC_PEERS_PYTHON (the python
    of a separate environment holding Mooncake and NIXL: benchmarks/peers/README.md) the peers
    run in the same repetitions."""
    _install(session, editable=False)
    _system_packages(session, "libfabric-dev", "gcc", "g++", "cmake", "pkg-config")
    session.install(*CONSTRAINTS, "pybind11", "scikit-build-core", "matplotlib")
    session.install(*CONSTRAINTS, "--no-build-isolation", "./packages/fabric-efa")
    build = Path(session.create_tmp()) / "fi_ceiling"
    session.run(
        "cc", "-O2", "-Wall", "-o", str(build), "benchmarks/ceiling/fi_ceiling.c", "-lfabric", external=True
    )
    session.run(
        "python",
        "benchmarks/efa_vs_ceiling.py",
        str(build),
        str(ROOT / "benchmarks" / "results"),
        *(
            ["--peers-python", os.environ["FABRIC_PEERS_PYTHON"]]
            if os.environ.get("FABRIC_PEERS_PYTHON")
            else []
        ),
        *session.posargs,
    )


def _app_bench_on_shm(session: nox.Session, app: str, stem: str) -> None:
    """``fabric bench APP`` on fabric-efa over shm with the raw-libfabric ceiling built and run
    in the same invocation; JSON and plot to benchmarks/results/STEM.*."""
    _install(session, editable=False)
    _system_packages(session, "libfabric-dev", "gcc", "g++", "cmake", "pkg-config")
    session.install(*CONSTRAINTS, "pybind11", "scikit-build-core", "matplotlib", "torch")
    session.install(*CONSTRAINTS, "--no-build-isolation", "./packages/fabric-efa")
    build = Path(session.create_tmp()) / "fi_ceiling"
    session.run(
        "cc", "-O2", "-Wall", "-o", str(build), "benchmarks/ceiling/fi_ceiling.c", "-lfabric", external=True
    )
    out = ROOT / "benchmarks" / "results"
    session.run(
        "fabric",
        "bench",
        app,
        "--backend",
        "efa",
        "--ceiling",
        str(build),
        "--json",
        str(out / f"{stem}.json"),
        "--plot",
        str(out / f"{stem}.png"),
        *session.posargs,
        env={"FI_TCP_IFACE": "lo", "FABRIC_EFA_PROVIDER": "shm"},
    )


@nox.session(name="kv-bench")
def kv_bench(session: nox.Session) -> None:
    """``fabric bench kv`` on fabric-efa over shm at both model shapes, with the raw-libfabric
    ceiling run before and after in the same invocation; JSON and plot to benchmarks/results
    (kv-shm.*). Options after -- go to ``fabric bench kv``."""
    _app_bench_on_shm(session, "kv", "kv-shm")


@nox.session(name="rl-bench")
def rl_bench(session: nox.Session) -> None:
    """``fabric bench rl`` on fabric-efa over shm (4 trainers -> 2 inference ranks, the 2 GiB
    model), with the raw-libfabric ceiling run before and after in the same invocation; JSON
    and plot to benchmarks/results (rl-shm.*). Options after -- go to ``fabric bench rl``."""
    _app_bench_on_shm(session, "rl", "rl-shm")


@nox.session
def soak(session: nox.Session) -> None:
    """The conformance suite over many more seeds (FABRIC_SOAK_SEEDS, default 200), then the
    efa soak across processes with NIC faults for FABRIC_SOAK_MINUTES per provider (default 5):
    exact counts, flat descriptors and threads, memory slopes (benchmarks/soak.py)."""
    _install(session, "test")
    seeds = os.environ.get("FABRIC_SOAK_SEEDS", "200")
    session.run("pytest", "packages/fabric-sim/tests", "-q", "--fabric-seeds", seeds, *session.posargs)
    _system_packages(session, "libfabric-dev", "g++", "cmake", "pkg-config")
    session.install(*CONSTRAINTS, "pybind11", "scikit-build-core")
    session.install(*CONSTRAINTS, "--no-build-isolation", "./packages/fabric-efa")
    minutes = os.environ.get("FABRIC_SOAK_MINUTES", "5")
    out = ROOT / "bench-results" / "soak.json"
    session.run(
        "python", "benchmarks/soak.py", "--minutes", minutes, "--json", str(out), env={"FI_TCP_IFACE": "lo"}
    )


# `nox -s sanitize` (docs/backends/efa.md, "Sanitizers"): the compiled backends built with ASan and
# UBSan and their device-free tests run under them, and the engine core's threads under TSan.
SANITIZE = "address,undefined"
NATIVE_TESTS = ROOT / "packages" / "fabric-core" / "tests" / "native"
TSAN_TEST = NATIVE_TESTS / "tsan_engine.cpp"
LIVENESS_TEST = NATIVE_TESTS / "liveness.cpp"
# The control-frame fuzz target (libFuzzer), its corpus and the findings kept as regressions.
FRAMES_TARGET = NATIVE_TESTS / "fuzz_frames.cpp"
FRAMES_CORPUS = ROOT / "tests" / "fuzz" / "corpus-frames"
FRAMES_CRASHES = ROOT / "tests" / "fuzz" / "frame-crashes"
ENGINE_INCLUDE = ROOT / "packages" / "fabric-core" / "src" / "fabric_core" / "include"
# The efa tests run under ASan: the conformance suite (shm and tcp, in-process and across
# processes), the counters and the fast path. Not the netns labs: they spend their time in
# timeouts and the kernel's networking, not in our code, and would double the session.
SANITIZE_EFA_TESTS = ("test_conformance.py", "test_counters.py", "test_fast_path.py", "test_backend.py")


def _sanitizer_env() -> dict[str, str]:
    """Run-time settings for a Python that loads an ASan+UBSan-built extension. Python is not
    built with ASan, so the runtime is preloaded (it must come first in the library list), and
    libstdc++ with it: ASan resolves the C++ functions it intercepts (__cxa_throw) when it
    starts, and python does not link libstdc++, so without it the first C++ exception thrown
    aborts in ASan's own CHECK. Leak checking is off: CPython keeps its arenas and interned
    objects at exit by design, so every run would report them. A report aborts the process
    (and the extensions are built with -fno-sanitize-recover=all), which fails the test and so
    the session."""

    def gcc_file(name: str) -> str:
        out = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
        return out.stdout.strip()

    return {
        "LD_PRELOAD": f"{gcc_file('libasan.so')} {gcc_file('libstdc++.so')}",
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1"
        ":detect_stack_use_after_return=1:check_initialization_order=1",
        "UBSAN_OPTIONS": "halt_on_error=1:abort_on_error=1:print_stacktrace=1",
        "FI_TCP_IFACE": "lo",
    }


@nox.session
def sanitize(session: nox.Session) -> None:
    """The native code under sanitizers (see _sanitize); also the last step of ``check``."""
    _sanitize(session)


def _sanitize(session: nox.Session) -> None:
    """The engine core's queues, counters and threads under ThreadSanitizer (a native test),
    then fabric-efa and fabric-verbs built with AddressSanitizer + UndefinedBehaviorSanitizer
    (build/sanitize in each package) and their device-free tests run under them. Any report
    fails the session. FABRIC_SANITIZE_SEEDS: conformance seeds (default 1)."""
    _system_packages(session, "libfabric-dev", "libibverbs-dev", "g++", "cmake", "pkg-config")
    tmp = Path(session.create_tmp())
    tsan, frames = str(tmp / "tsan_engine"), str(tmp / "fuzz_frames_replay")
    cxx = ("g++", "-std=c++17", "-Wall", "-g", "-O1", "-I", str(ENGINE_INCLUDE))
    session.run(*cxx, "-fsanitize=thread", str(TSAN_TEST), "-o", tsan, "-pthread", external=True)
    session.run(tsan, external=True, env={"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1"})
    # liveness probes against a peer that cannot answer at once, under ThreadSanitizer too
    live = str(tmp / "liveness")
    session.run(*cxx, "-fsanitize=thread", str(LIVENESS_TEST), "-o", live, "-pthread", external=True)
    session.run(live, external=True, env={"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1"})
    # the control-frame fuzz corpus and its kept findings, replayed under ASan and UBSan
    session.run(
        *cxx,
        f"-fsanitize={SANITIZE}",
        "-fno-sanitize-recover=all",
        "-DFABRIC_FUZZ_REPLAY",
        str(FRAMES_TARGET),
        "-o",
        frames,
        "-pthread",
        external=True,
    )
    kept = [str(d) for d in (FRAMES_CORPUS, FRAMES_CRASHES) if d.is_dir()]
    session.run(frames, *kept, external=True)

    _install(session, "test")
    session.install(*CONSTRAINTS, "pybind11", "scikit-build-core")
    for pkg in ("fabric-efa", "fabric-verbs"):
        session.install(
            *CONSTRAINTS,
            "--no-build-isolation",
            "--config-settings=build-dir=build/sanitize/{wheel_tag}",
            "--config-settings=cmake.build-type=Debug",
            f"--config-settings=cmake.define.FABRIC_SANITIZE={SANITIZE}",
            f"./packages/{pkg}",
        )
    env = _sanitizer_env()
    seeds = os.environ.get("FABRIC_SANITIZE_SEEDS", "1")
    efa_tests = [f"packages/fabric-efa/tests/{t}" for t in SANITIZE_EFA_TESTS]
    # --capture=sys: a report is written to fd 2 just before the abort; pytest's fd capture
    # would swallow it (and the worker processes, started mid-test, inherit fd 2)
    pytest = ("pytest", "-q", "--capture=sys", "--fabric-seeds", seeds)
    session.run(*pytest, *efa_tests, *session.posargs, env=env)
    session.run(*pytest, "packages/fabric-verbs/tests", *session.posargs, env=env)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Coverage-guided fuzzing (atheris, libFuzzer) of what parses peer and user bytes
    (tests/fuzz/fuzz_descriptors.py): the descriptor, address, device and page-index parsers,
    then forged peer addresses through the efa engine on shm. ``nox -s fuzz -- SECONDS``
    (default 60 per run). A finding fails the session and is written to fuzz-artifacts/; keep
    it in tests/fuzz/crashes/ (the default test run replays those with the corpus)."""
    _system_packages(session, "libfabric-dev", "g++", "cmake", "pkg-config")
    session.install(*CONSTRAINTS, "atheris==2.3.0", "pybind11", "scikit-build-core", "./packages/fabric-core")
    session.install(
        *CONSTRAINTS,
        "--no-build-isolation",
        "--config-settings=build-dir=build/fuzz/{wheel_tag}",
        "./packages/fabric-efa",
    )
    seconds = session.posargs[0] if session.posargs else "60"
    runner = (
        "python",
        "tests/fuzz/fuzz_descriptors.py",
        "--seconds",
        seconds,
        "--artifacts",
        "fuzz-artifacts",
    )
    session.run(*runner, env={"FI_TCP_IFACE": "lo"})
    session.run(*runner, "--native", env={"FI_TCP_IFACE": "lo"})
    _fuzz_frames(session, seconds)


def _fuzz_frames(session: nox.Session, seconds: str) -> None:
    """The engine core's control-frame parsing (packages/fabric-core/tests/native/fuzz_frames.cpp)
    under libFuzzer with ASan and UBSan, for ``seconds``, from tests/fuzz/corpus-frames/ (new
    inputs go to a scratch copy; FABRIC_FUZZ_UPDATE=1 merges them into the corpus, minimised).
    A finding is written to fuzz-artifacts/frames-*; keep it in tests/fuzz/frame-crashes/
    (``nox -s sanitize`` and the default test run replay those)."""
    _system_packages(session, "clang-14", "libclang-rt-14-dev")
    tmp = Path(session.create_tmp())
    binary, scratch = str(tmp / "fuzz_frames"), tmp / "frames-corpus"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(FRAMES_CORPUS, scratch)
    Path("fuzz-artifacts").mkdir(exist_ok=True)
    session.run(
        "clang++-14",
        "-std=c++17",
        "-g",
        "-O1",
        "-fsanitize=fuzzer,address,undefined",
        "-fno-sanitize-recover=all",
        "-I",
        str(ENGINE_INCLUDE),
        str(FRAMES_TARGET),
        "-o",
        binary,
        "-pthread",
        external=True,
    )
    session.run(
        binary,
        str(scratch),
        f"-max_total_time={seconds}",
        "-artifact_prefix=fuzz-artifacts/frames-",
        "-print_final_stats=1",
        external=True,
    )
    if os.environ.get("FABRIC_FUZZ_UPDATE") == "1":
        session.run(binary, "-merge=1", str(FRAMES_CORPUS), str(scratch), external=True)
