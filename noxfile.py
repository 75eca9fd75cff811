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
    """Everything CI runs: lint, types, docs, the test suite with coverage, then fabric-efa."""
    _install(session, "test", "lint", "docs")
    _lint(session)
    _typecheck(session)
    _docs(session)
    _pytest(session)
    _efa(session)  # last: installing the backends changes what the registry tests see
    _verbs(session)


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
    """mypy --strict on fabric_core and fabric_sim."""
    _install(session, "lint")
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


@nox.session
def soak(session: nox.Session) -> None:
    """The conformance suite over many more seeds (FABRIC_SOAK_SEEDS, default 200)."""
    _install(session, "test")
    seeds = os.environ.get("FABRIC_SOAK_SEEDS", "200")
    session.run("pytest", "packages/fabric-sim/tests", "-q", "--fabric-seeds", seeds, *session.posargs)
